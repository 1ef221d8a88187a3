//! The schedules against the properties the literature states for them.

use super::*;

fn all_stages(kind: Kind, p: usize, m: usize) -> Vec<Vec<Step>> {
    (0..p).map(|s| schedule(kind, s, p, m)).collect()
}

#[test]
fn every_schedule_runs_each_micro_batch_once_without_deadlock() {
    for kind in [Kind::GPipe, Kind::OneFOneB] {
        for p in 1..=6 {
            for m in 1..=9 {
                let all = all_stages(kind, p, m);
                check(&all, m).unwrap_or_else(|e| panic!("{kind:?} p={p} m={m}: {e}"));
                replay(&all, 1.0, 2.0).unwrap_or_else(|e| panic!("{kind:?} p={p} m={m}: {e}"));
            }
        }
    }
}

#[test]
fn the_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for kind in [Kind::GPipe, Kind::OneFOneB] {
        for p in 1..=6 {
            for m in 1..=9 {
                let r = replay(&all_stages(kind, p, m), 1.0, 2.0).unwrap();
                let want = (p - 1) as f64 / (m + p - 1) as f64;
                assert!(
                    (r.bubble() - want).abs() < 1e-12,
                    "{kind:?} p={p} m={m}: bubble {} vs {want}",
                    r.bubble()
                );
                assert_eq!(r.makespan, 3.0 * (m + p - 1) as f64, "{kind:?} p={p} m={m}");
            }
        }
    }
}

#[test]
fn activations_held_are_m_under_gpipe_and_at_most_p_minus_s_under_1f1b() {
    for p in 1..=6 {
        for m in 1..=9 {
            for s in 0..p {
                assert_eq!(peak_activations(&schedule(Kind::GPipe, s, p, m)), m);
                assert_eq!(
                    peak_activations(&schedule(Kind::OneFOneB, s, p, m)),
                    (p - s).min(m),
                    "p={p} m={m} stage {s}"
                );
            }
        }
    }
}

#[test]
fn the_checks_can_fail() {
    // 1F1B with Megatron's batched pairs written send-first on both sides: the first stage
    // sends the next activation while the second sends a gradient, and both wait.
    let naive = |s: usize, p: usize, m: usize| -> Vec<Step> {
        let mut out = Vec::new();
        let warmup = (p - s - 1).min(m);
        let fwd = |mb, out: &mut Vec<Step>| {
            if s > 0 {
                out.push(Step::RecvActivation(mb));
            }
            out.push(Step::Forward(mb));
            if s + 1 < p {
                out.push(Step::SendActivation(mb));
            }
        };
        let bwd = |mb, out: &mut Vec<Step>| {
            if s + 1 < p {
                out.push(Step::RecvGrad(mb));
            }
            out.push(Step::Backward(mb));
            if s > 0 {
                out.push(Step::SendGrad(mb));
            }
        };
        for mb in 0..warmup {
            fwd(mb, &mut out);
        }
        for i in 0..m - warmup {
            fwd(warmup + i, &mut out);
            bwd(i, &mut out);
        }
        for mb in m - warmup..m {
            bwd(mb, &mut out);
        }
        out
    };
    let all: Vec<Vec<Step>> = (0..3).map(|s| naive(s, 3, 4)).collect();
    check(&all, 4).unwrap();
    let e = replay(&all, 1.0, 2.0).unwrap_err();
    assert!(e.contains("deadlock"), "{e}");
    // A backward before its forward, and a micro-batch run twice.
    let bad = vec![vec![Step::Backward(0), Step::Forward(0)]];
    assert!(check(&bad, 1).unwrap_err().contains("before its forward"));
    let twice = vec![vec![Step::Forward(0), Step::Forward(0), Step::Backward(0)]];
    assert!(check(&twice, 1).is_err());
}

#[test]
fn stage_layers_split_evenly_or_as_asked_and_refuse_bad_sizes() {
    assert_eq!(
        stage_layers(30, 4, None).unwrap(),
        vec![0..8, 8..16, 16..23, 23..30]
    );
    assert_eq!(
        stage_layers(4, 4, None).unwrap(),
        vec![0..1, 1..2, 2..3, 3..4]
    );
    assert_eq!(stage_layers(7, 1, None).unwrap(), vec![0..7]);
    let e = stage_layers(3, 4, None).unwrap_err().to_string();
    assert!(e.contains("4 stages") && e.contains("3 layers"), "{e}");
    for bad in [&[10, 10][..], &[10, 10, 9], &[30, 0, 0], &[10, 10, 11]] {
        let e = stage_layers(30, 3, Some(bad)).unwrap_err().to_string();
        assert!(e.contains(&format!("{bad:?}")), "{e}");
    }
}

#[test]
fn the_pp_dp_tp_mesh_keeps_tp_groups_consecutive() {
    use crate::comm::{run_threads, DeviceMesh};
    let got = run_threads(8, |pg| {
        let mesh = DeviceMesh::pp_dp_tp(&pg, 2, 2)?;
        let name = |axis: usize| mesh.group_along(axis).expect("a member").name().to_string();
        Ok((mesh.coord().to_vec(), name(0), name(1), name(2)))
    })
    .unwrap();
    for (rank, (coord, pp, dp, tp)) in got.iter().enumerate() {
        assert_eq!(
            coord,
            &vec![rank / 4, (rank / 2) % 2, rank % 2],
            "rank {rank}"
        );
        // The stage peers differ by 4, the data-parallel peers by 2, the TP pair is consecutive.
        let (s0, d0, t0) = (rank % 4, rank - (rank / 2 % 2) * 2, rank - rank % 2);
        assert_eq!(pp, &format!("world/pp[{},{}]", s0, s0 + 4), "rank {rank}");
        assert_eq!(dp, &format!("world/dp[{},{}]", d0, d0 + 2), "rank {rank}");
        assert_eq!(tp, &format!("world/tp[{},{}]", t0, t0 + 1), "rank {rank}");
    }
    let e = run_threads(4, |pg| Ok(DeviceMesh::pp_dp_tp(&pg, 3, 1).map(|_| ())?))
        .unwrap_err()
        .to_string();
    assert!(e.contains("pipeline size 3"), "{e}");
}

/// A stage's part: the whole model without a pipeline; with three stages of a 7-layer model
/// the layers of `stage_layers`, the embedding on the first stage (and the last when tied),
/// and an error naming the model and the stage when there are more stages than layers.
#[test]
fn stage_parts_hold_their_layers_and_ends() {
    let whole = StagePart::of(None, "M", 7).unwrap();
    assert_eq!((whole.first, whole.last, whole.layers), (true, true, 0..7));
    let parts = crate::comm::run_threads(3, |world| {
        let (stage, _) = PipelineStage::split(&world, 3, None)?;
        let part = StagePart::of(Some(&stage), "M", 7).map_err(|e| e.to_string());
        let few = StagePart::of(Some(&stage), "M", 2).map(|_| ());
        Ok((part, few.map_err(|e| e.to_string())))
    })
    .unwrap();
    let want = stage_layers(7, 3, None).unwrap();
    for (s, (part, few)) in parts.into_iter().enumerate() {
        let part = part.unwrap();
        assert_eq!(part.layers, want[s], "stage {s}");
        assert_eq!((part.first, part.last), (s == 0, s == 2), "stage {s}");
        assert_eq!(part.holds_embedding(false), s == 0, "stage {s}");
        assert_eq!(part.holds_embedding(true), s != 1, "stage {s}");
        let e = few.unwrap_err();
        assert!(e.contains(&format!("M: pipeline stage {s} of 3")), "{e}");
    }
}
