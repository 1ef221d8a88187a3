//! Engine tests that need its internals: two ranks attached to one in-process region.

use std::time::Duration;

use super::{region_layout, Engine};
use crate::comm::element::ReduceOp;
use crate::comm::region::{self, RegionKind};

/// Ranks whose `CANDLE_TP_ONESHOT_BYTES` differ must still run one protocol: the creator's
/// threshold is in the region header and every rank uses it. A 4 KiB all-reduce lies between
/// the two thresholds below, so without the header rank 0 would run one-shot and rank 1
/// reduce-scatter + all-gather (a timeout or garbage).
#[test]
fn ranks_with_different_one_shot_thresholds_agree_through_the_header() {
    let name = format!("engine-test-{}", region::random_hex());
    let slot = 64 << 10;
    let (_, len) = region_layout(2, slot).unwrap();
    let map = region::create(RegionKind::InProcess, &name, len).unwrap();
    let timeout = Duration::from_secs(3);
    std::env::set_var("CANDLE_TP_ONESHOT_BYTES", "65536");
    let e0 = Engine::attach(map.clone(), "t".into(), 0, 2, slot, timeout, true, 2);
    std::env::set_var("CANDLE_TP_ONESHOT_BYTES", "1024");
    let e1 = Engine::attach(map, "t".into(), 1, 2, slot, timeout, false, 2);
    std::env::remove_var("CANDLE_TP_ONESHOT_BYTES");
    region::unlink(RegionKind::InProcess, &name);
    let engines = [e0.unwrap(), e1.unwrap()];
    assert_eq!(
        engines[1].one_shot_max, 65536,
        "rank 1 uses the creator's threshold"
    );
    let n = 1024; // 4 KiB of f32
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .into_iter()
            .enumerate()
            .map(|(r, mut e)| {
                s.spawn(move || {
                    let src: Vec<f32> = (0..n).map(|i| (i * (r + 1)) as f32 * 0.5).collect();
                    let mut dst = vec![0f32; n];
                    // SAFETY: distinct buffers of n elements.
                    unsafe { e.all_reduce(src.as_ptr(), dst.as_mut_ptr(), n, ReduceOp::Sum) }
                        .map(|_| dst)
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    let want: Vec<f32> = (0..n)
        .map(|i| i as f32 * 0.5 + (2 * i) as f32 * 0.5)
        .collect();
    assert_eq!(results[0], want);
    assert_eq!(results[1], want);
}

/// Region sizes from user tunables are computed with checked arithmetic: an absurd
/// `CANDLE_TP_SLOT_BYTES` is an error naming the sizes, not a wrapped length.
#[test]
fn region_layout_overflow_is_an_error() {
    let e = region_layout(64, usize::MAX / 64).unwrap_err().to_string();
    assert!(e.contains("64 ranks") && e.contains("bytes"), "{e}");
    assert!(region_layout(2, 4 << 20).is_ok());
}

/// The wait policy counts the ranks sharing the host, not the group's size: a 2-rank
/// sub-group of a job with more ranks than cores is oversubscribed too (short spin).
#[test]
fn a_small_sub_group_of_an_oversubscribed_host_spins_briefly() {
    if std::env::var_os("CANDLE_TP_SPIN_US").is_some() {
        return; // an explicit spin overrides the policy under test
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let name = format!("engine-test-{}", region::random_hex());
    let slot = 4096;
    let (_, len) = region_layout(2, slot).unwrap();
    let map = region::create(RegionKind::InProcess, &name, len).unwrap();
    region::unlink(RegionKind::InProcess, &name);
    let t = Duration::from_secs(1);
    let sub = Engine::attach(map.clone(), "s".into(), 0, 2, slot, t, true, cores + 1).unwrap();
    assert_eq!(sub.policy.spin, Duration::from_micros(2), "{cores} cores");
    if cores >= 2 {
        let alone = Engine::attach(map, "s".into(), 1, 2, slot, t, false, 2).unwrap();
        assert_eq!(
            alone.policy.spin,
            Duration::from_micros(20),
            "{cores} cores"
        );
    }
}

/// A rank whose slot size differs from the region's creator's (`CANDLE_TP_SLOT_BYTES` set
/// differently) fails with an error naming itself, the creator and both sizes, whichever of
/// the two is at fault (issue 44: the suite's `error-join` fault on a host's first rank was
/// reported by its peer without a rank).
#[test]
fn a_slot_size_that_differs_from_the_creators_names_both_ranks() {
    let name = format!("engine-test-{}", region::random_hex());
    let (big, small) = (128 << 10, 64 << 10);
    let (_, len) = region_layout(3, big).unwrap();
    let map = region::create(RegionKind::InProcess, &name, len).unwrap();
    let timeout = Duration::from_secs(3);
    // Rank 2 creates the region with the larger slots; rank 0 attaches with the smaller.
    let creator = Engine::attach(map.clone(), "t".into(), 2, 3, big, timeout, true, 3);
    let other = Engine::attach(map, "t".into(), 0, 3, small, timeout, false, 3);
    region::unlink(RegionKind::InProcess, &name);
    assert!(creator.is_ok());
    let e = other.err().expect("a mismatch").to_string();
    for part in [
        "rank 0",
        "rank 2",
        "131072-byte",
        "65536-byte",
        "CANDLE_TP_SLOT_BYTES",
    ] {
        assert!(e.contains(part), "the error should name {part}: {e}");
    }
}

/// A wait whose peer reached the phase completes even when that peer aborted the group just
/// after (an argument error in its next call): CI failed once so, rank 1 of a 2-rank test
/// reporting "aborted by rank 0" from the rendezvous barrier rank 0 had already passed.
#[test]
fn a_wait_on_a_peer_that_arrived_then_aborted_succeeds() {
    let name = format!("engine-test-{}", region::random_hex());
    let slot = 4096;
    let (_, len) = region_layout(2, slot).unwrap();
    let map = region::create(RegionKind::InProcess, &name, len).unwrap();
    region::unlink(RegionKind::InProcess, &name);
    let timeout = Duration::from_secs(3);
    let mut e0 = Engine::attach(map.clone(), "t".into(), 0, 2, slot, timeout, true, 2).unwrap();
    let mut e1 = Engine::attach(map, "t".into(), 1, 2, slot, timeout, false, 2).unwrap();
    let (phase, _) = e0.next_phase();
    assert_eq!(e1.next_phase().0, phase);
    e0.publish(phase);
    e0.abort("rank 0: an argument error in its next call");
    let deadline = crate::comm::wait::Deadline::after(timeout);
    e1.sleep_until(0, e1.record(0), phase, "barrier", deadline)
        .expect("rank 0 reached the phase before it aborted");
    // A phase rank 0 never reached fails with its reason at once.
    let next = phase.wrapping_add(1);
    let e = e1
        .sleep_until(0, e1.record(0), next, "barrier", deadline)
        .unwrap_err()
        .to_string();
    assert!(e.contains("an argument error"), "{e}");
}
