//! Every collective across emulated hosts (`scripts/hosts.sh`), against the exact result and
//! against the same job on one host:
//!
//! - 2 hosts x 2 ranks (the even hierarchical layout), 2 + 1 ranks (the uneven one), and 2 x 2 on
//!   flat MPI, with `--map-by node` so that a host's ranks are not consecutive;
//! - sums in f32 within 1e-6 of the exact f64 sum (relative to the sum of magnitudes), every
//!   rank the same bits as every other, gathers, all-to-alls and broadcasts bit-exact, and
//!   each checksum within 1e-6 of the one-host run's (shm backend, same ranks);
//! - sub-groups that live on one host (shm), one per host (MPI) or spread unevenly
//!   (hierarchical), point-to-point across and inside hosts;
//! - bytes that crossed hosts against the formula: a hierarchical all-reduce hands each rank's
//!   1/l shard to MPI (l ranks per host), a flat one the whole buffer; one of 4 KB goes
//!   through each host's first rank;
//! - all-to-alls of every element type, with empty blocks and one block larger than an shm
//!   slot; on 2 x 2 the hierarchical one is the composed exchange (counted as an all-to-all,
//!   each block across hosts once), on 2 + 1 the all-gather form (counted as all-gathers).
//!
//! Needs root, iproute2, Open MPI and the `mpi` feature; elsewhere it prints `SKIPPED: ...`.

#![cfg(feature = "mpi")]

mod common;

use std::collections::BTreeMap;

use candle_tp::comm::{CollectiveKind, Element, ProcessGroup, ReduceOp};
use common::hosts::Hosts;

const WORKER: &str = "CANDLE_TP_HOSTS_COLLECTIVES_WORKER";

/// What a layout's job printed: per rank, per check name, its line's value.
type Report = BTreeMap<usize, BTreeMap<String, String>>;

fn run(hosts: &Hosts, np: usize, extra: &[&str], expect: &str) -> Report {
    let mut c = hosts.mpirun(np);
    c.args(extra)
        .args(["-x", &format!("{WORKER}={expect}")])
        .arg(std::env::current_exe().expect("test binary"))
        .args(["--ignored", "--exact", "worker", "--nocapture"])
        .args(["--test-threads", "1"]);
    let out = c.output().expect("mpirun");
    let t = common::output_text(&out);
    assert!(out.status.success(), "{np} ranks, {extra:?}:\n{t}");
    let mut report = Report::new();
    // "[1,R]<stdout>:check NAME VALUE"; mpirun may run one rank's output into another's line
    // ("[1,1]<stdout>:ok[1,0]<stdout>:check done ok"), so every tag starts a segment.
    for segment in t.lines().flat_map(|l| l.split("[1,").skip(1)) {
        let Some((rank, line)) = segment.split_once("]<stdout>:check ") else {
            continue;
        };
        let (Ok(rank), Some((name, value))) = (rank.parse(), line.trim().split_once(' ')) else {
            continue;
        };
        report
            .entry(rank)
            .or_default()
            .insert(name.to_string(), value.to_string());
    }
    assert_eq!(report.len(), np, "not every rank reported:\n{t}");
    for (r, checks) in &report {
        assert_eq!(
            checks.get("done").map(String::as_str),
            Some("ok"),
            "rank {r} did not finish:\n{t}"
        );
    }
    report
}

/// Every rank printed the same value for every check but `rank_*` ones.
fn same_on_every_rank(report: &Report, what: &str) {
    let first = &report[&0];
    for (r, checks) in report {
        for (name, v) in checks.iter().filter(|(n, _)| !n.starts_with("rank_")) {
            assert_eq!(
                Some(v),
                first.get(name),
                "{what}: rank {r} and rank 0 differ on {name}"
            );
        }
    }
}

/// Checksums (`sum_*`) within 1e-6 relative, bit hashes (`bits_*` of exact collectives) equal.
fn same_as_one_host(many: &Report, one: &Report, what: &str) {
    for (name, v) in &many[&0] {
        let w = &one[&0][name];
        if let Some(exact) = name.strip_prefix("bits_") {
            if exact.starts_with("gather") || exact.starts_with("broadcast") {
                assert_eq!(v, w, "{what}: {name} differs from one host");
            }
        } else if name.starts_with("sum_") {
            let (a, b): (f64, f64) = (v.parse().unwrap(), w.parse().unwrap());
            assert!(a.is_finite() && b.is_finite(), "{what}: {name} {a} {b}");
            assert!(
                (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0),
                "{what}: {name} is {a} across hosts, {b} on one host"
            );
        }
    }
}

#[test]
fn collectives_across_emulated_hosts() {
    let Some(hosts) = Hosts::up(2) else { return };
    for (np, layout) in [(4, "2x2"), (3, "2+1")] {
        let across = run(&hosts, np, &[], &format!("hierarchical,{layout}"));
        same_on_every_rank(&across, layout);
        // The same ranks on one emulated host: the shm backend.
        let one = run(
            &hosts,
            np,
            &["--host", &format!("ctp-h1:{np}")],
            &format!("shm,{layout}"),
        );
        same_on_every_rank(&one, "one host");
        same_as_one_host(&across, &one, layout);
    }
    let flat = run(&hosts, 4, &["-x", "CANDLE_TP_BACKEND=mpi"], "mpi,2x2");
    same_on_every_rank(&flat, "flat MPI");
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn bits_f32(v: &[f32]) -> u64 {
    fnv(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())
}

/// Rank `r`'s input: values in [-0.5, 0.5) that differ per rank and index.
fn input(r: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + r * 104_729 + salt * 31) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

/// `got` is the sum over `ranks` of their inputs (indices `offset..`), within 1e-6 of the sum
/// of magnitudes.
fn check_sum(what: &str, got: &[f32], ranks: &[usize], n: usize, salt: usize, offset: usize) {
    let inputs: Vec<Vec<f32>> = ranks.iter().map(|&r| input(r, n, salt)).collect();
    for (k, g) in got.iter().enumerate() {
        let i = offset + k;
        assert!(g.is_finite(), "{what}: {g} at {i}");
        let exact: f64 = inputs.iter().map(|x| x[i] as f64).sum();
        let mag: f64 = inputs.iter().map(|x| (x[i] as f64).abs()).sum();
        assert!(
            (*g as f64 - exact).abs() <= 1e-6 * mag.max(1e-30),
            "{what}: {g} at {i}, exact {exact}"
        );
    }
}

fn report(name: &str, value: impl std::fmt::Display) {
    println!("check {name} {value}");
}

fn checksum(v: &[f32]) -> f64 {
    v.iter().map(|&x| x as f64).sum()
}

/// The collectives of `pg` (whose members are world ranks `members`), reported under `tag`.
fn exercise(pg: &ProcessGroup, members: &[usize], tag: &str) {
    let (rank, size) = (pg.rank(), pg.size());
    let me = members[rank];
    for n in [0usize, 1, 7, 1000, 100_003] {
        // all_reduce, in place and into another buffer.
        let mut v = input(me, n, 1);
        pg.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        check_sum(&format!("{tag} all_reduce {n}"), &v, members, n, 1, 0);
        report(&format!("bits_all_reduce_{tag}_{n}"), bits_f32(&v));
        report(&format!("sum_all_reduce_{tag}_{n}"), checksum(&v));
        let src = input(me, n, 2);
        let mut dst = vec![f32::NAN; n];
        pg.all_reduce_slice_into(&src, &mut dst, ReduceOp::Sum)
            .unwrap();
        check_sum(
            &format!("{tag} all_reduce_into {n}"),
            &dst,
            members,
            n,
            2,
            0,
        );
        // reduce_scatter with uneven blocks (rank r gets n/size + r, the last the rest).
        let mut counts: Vec<usize> = (0..size).map(|r| (n / (2 * size)) + r).collect();
        let used: usize = counts.iter().sum();
        if used > n {
            counts = vec![0; size];
            counts[0] = n;
        } else {
            counts[size - 1] += n - used;
        }
        let at: usize = counts[..rank].iter().sum();
        let mut block = vec![f32::NAN; counts[rank]];
        pg.reduce_scatter_v_slice(&input(me, n, 3), &mut block, &counts, ReduceOp::Sum)
            .unwrap();
        check_sum(
            &format!("{tag} reduce_scatter {n}"),
            &block,
            members,
            n,
            3,
            at,
        );
        report(
            &format!("rank_bits_reduce_scatter_{tag}_{n}"),
            bits_f32(&block),
        );
        // all_gather of those uneven blocks.
        let mine = input(me, n, 4)[at..at + counts[rank]].to_vec();
        let mut all = vec![f32::NAN; n];
        pg.all_gather_v_slice(&mine, &mut all, &counts).unwrap();
        let mut want = Vec::with_capacity(n);
        for (r, &c) in counts.iter().enumerate() {
            let a: usize = counts[..r].iter().sum();
            want.extend_from_slice(&input(members[r], n, 4)[a..a + c]);
        }
        assert_eq!(bits_f32(&all), bits_f32(&want), "{tag} all_gather {n}");
        report(&format!("bits_gather_{tag}_{n}"), bits_f32(&all));
        // all_to_all with uneven blocks, some empty: rank s sends count(s, d) values to d.
        let count = |s: usize, d: usize| {
            if (s + d) % 3 == 2 {
                0
            } else {
                n / (size * size) + s + 2 * d
            }
        };
        let sent = |s: usize| (0..size).map(|d| count(s, d)).sum::<usize>();
        let send: Vec<usize> = (0..size).map(|d| count(rank, d)).collect();
        let recv: Vec<usize> = (0..size).map(|s| count(s, rank)).collect();
        let mut got = vec![f32::NAN; recv.iter().sum()];
        pg.all_to_all_v_slice(&input(me, sent(rank), 6), &send, &mut got, &recv)
            .unwrap();
        let mut want = Vec::with_capacity(got.len());
        for (s, &from) in members.iter().enumerate() {
            let a: usize = (0..rank).map(|d| count(s, d)).sum();
            want.extend_from_slice(&input(from, sent(s), 6)[a..a + count(s, rank)]);
        }
        assert_eq!(bits_f32(&got), bits_f32(&want), "{tag} all_to_all {n}");
        report(&format!("rank_bits_all_to_all_{tag}_{n}"), bits_f32(&got));
        // broadcast from the last rank and from rank 1.
        for root in [size - 1, 1] {
            let mut b = input(me, n, 5);
            pg.broadcast_slice(&mut b, root).unwrap();
            assert_eq!(
                bits_f32(&b),
                bits_f32(&input(members[root], n, 5)),
                "{tag} broadcast {n} from {root}"
            );
            report(&format!("bits_broadcast_{tag}_{n}_{root}"), bits_f32(&b));
        }
    }
    // Other types: i64 sums, f64 max with a NaN, bf16 bits.
    let mut i = [me as i64 * 3 - 1, 5];
    pg.all_reduce_slice(&mut i, ReduceOp::Sum).unwrap();
    let want: i64 = members.iter().map(|&r| r as i64 * 3 - 1).sum();
    assert_eq!(i, [want, 5 * size as i64], "{tag} i64");
    let mut m = [if rank == size - 1 { f64::NAN } else { 1.0 }, me as f64];
    pg.all_reduce_slice(&mut m, ReduceOp::Max).unwrap();
    let top = *members.iter().max().unwrap() as f64;
    assert!(m[0].is_nan() && m[1] == top, "{tag} f64 max {m:?}");
    let mut h: Vec<half::bf16> = (0..9)
        .map(|k| half::bf16::from_f32((me * 10 + k) as f32))
        .collect();
    pg.broadcast_slice(&mut h, 0).unwrap();
    let h0: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
    let want: Vec<f32> = (0..9).map(|k| (members[0] * 10 + k) as f32).collect();
    assert_eq!(h0, want, "{tag} bf16 broadcast");
    pg.barrier().unwrap();
}

/// An all-to-all of the world `pg` in element type `T`, block `s -> d` of `count(s, d)`
/// elements `val(x)`, `x` mixing source, destination and index; checked against the values
/// computed here.
fn all_to_all_typed<T: Element + PartialEq + std::fmt::Debug>(
    pg: &ProcessGroup,
    count: &dyn Fn(usize, usize) -> usize,
    val: impl Fn(usize) -> T,
) {
    let (rank, size) = (pg.rank(), pg.size());
    let block = |s: usize, d: usize| -> Vec<T> {
        (0..count(s, d))
            .map(|k| val(s * 7919 + d * 104_729 + k))
            .collect()
    };
    let src: Vec<T> = (0..size).flat_map(|d| block(rank, d)).collect();
    let send: Vec<usize> = (0..size).map(|d| count(rank, d)).collect();
    let recv: Vec<usize> = (0..size).map(|s| count(s, rank)).collect();
    let mut got = vec![T::default(); recv.iter().sum()];
    pg.all_to_all_v_slice(&src, &send, &mut got, &recv).unwrap();
    let want: Vec<T> = (0..size).flat_map(|s| block(s, rank)).collect();
    assert!(got == want, "all_to_all of {:?}", T::DTYPE);
}

/// All-to-alls of the world in every element type (uneven blocks, some empty), one with a
/// block of 1.2 M f32 (larger than a 4 MiB shm slot), and what the statistics of an
/// all-to-all say: on the hierarchical 2 x 2 layout one all-to-all call whose across-host
/// bytes are the blocks between hosts, each once (with `--map-by node`, host `r % 2`, local
/// index `r / 2`); on the 2 + 1 layout none (the all-gather form).
fn all_to_all_cases(pg: &ProcessGroup, backend: &str, layout: &str) {
    let (rank, size) = (pg.rank(), pg.size());
    let small = |s: usize, d: usize| {
        if (s * 2 + d) % 3 == 1 {
            0
        } else {
            3 + s + 5 * d
        }
    };
    all_to_all_typed(pg, &small, |x| x as f32 / 8.0);
    all_to_all_typed(pg, &small, |x| x as f64 / 8.0);
    all_to_all_typed(pg, &small, |x| half::f16::from_f32((x % 2048) as f32));
    all_to_all_typed(pg, &small, |x| half::bf16::from_f32((x % 256) as f32));
    all_to_all_typed(pg, &small, |x| (x % 251) as u8);
    all_to_all_typed(pg, &small, |x| x as u32);
    all_to_all_typed(pg, &small, |x| (x % 30_011) as i16 - 15_000);
    all_to_all_typed(pg, &small, |x| x as i32 - 500_000);
    all_to_all_typed(pg, &small, |x| x as i64 * -3);
    // Every block empty.
    all_to_all_typed(pg, &|_, _| 0, |x| x as f32);
    // One block larger than an shm slot, from rank 0 to the last rank (another host on 2 x 2).
    let large = |s: usize, d: usize| match (s, d) {
        (0, d) if d == size - 1 => 1_200_000,
        (s, d) if s == d => 0,
        (s, d) => 1000 * (s + 1) + d,
    };
    let before = pg.stats();
    all_to_all_typed(pg, &large, |x| x as f32);
    let moved = pg.stats().since(&before);
    let (a2a, gathers) = (
        moved.get(CollectiveKind::AllToAll),
        moved.get(CollectiveKind::AllGather),
    );
    let others = |mine: &dyn Fn(usize) -> usize| (0..size).filter(|&r| r != rank).map(mine).sum();
    let sent: usize = others(&|d| large(rank, d));
    let received: usize = others(&|s| large(s, rank));
    let payload = 4 * sent.max(received) as u64;
    // The size agreement is one all-gather; the all-gather form adds one.
    let composed = !(backend == "hierarchical" && layout == "2+1");
    assert_eq!(
        (a2a.calls, gathers.calls),
        if composed { (1, 1) } else { (0, 2) },
        "{backend} {layout}: all-to-all calls and all-gathers"
    );
    if composed {
        assert_eq!(a2a.payload_bytes, payload, "{backend} {layout}: payload");
        let (host, index) = (rank % 2, rank / 2);
        let want = match backend {
            "shm" => 0,
            "mpi" => payload,
            // Across, among this local index: to the other host's member of this index what
            // this host's members have for it, and from the other host's members.
            _ => {
                let peer = (1 - host) + 2 * index;
                let out: usize = (0..size)
                    .filter(|s| s % 2 == host)
                    .map(|s| large(s, peer))
                    .sum();
                let inn: usize = (0..size)
                    .filter(|s| s % 2 != host)
                    .map(|s| large(s, rank))
                    .sum();
                4 * out.max(inn) as u64
            }
        };
        assert_eq!(
            a2a.cross_host_bytes, want,
            "{backend} {layout}: bytes across hosts"
        );
    }
}

/// The worker side: run by `mpirun` on the hosts; does nothing unless started by the test.
#[test]
#[ignore]
fn worker() {
    let Ok(expect) = std::env::var(WORKER) else {
        return;
    };
    let (backend, layout) = expect.split_once(',').expect("BACKEND,LAYOUT");
    // The test harness printed "test worker ... " without a newline.
    println!();
    let pg = candle_tp::init_from_env(&candle_core::Device::Cpu).expect("init");
    let (rank, world) = (pg.rank(), pg.size());
    assert_eq!(pg.backend(), backend, "the world's backend");
    let world_members: Vec<usize> = (0..world).collect();
    exercise(&pg, &world_members, "world");
    all_to_all_cases(&pg, backend, layout);

    // Bytes across hosts for one all-reduce of n f32.
    let n = 100_000;
    let before = pg.stats();
    let mut v = vec![1f32; n];
    pg.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
    assert!(v.iter().all(|&x| x == world as f32));
    let moved = pg.stats().since(&before).get(CollectiveKind::AllReduce);
    let local_rank: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_RANK")
        .unwrap()
        .parse()
        .unwrap();
    let want = match (backend, layout) {
        ("shm", _) => 0,
        // 2 ranks per host: each hands half the buffer to MPI.
        ("hierarchical", "2x2") => 4 * n / 2,
        // Uneven: the hosts' first ranks hand the whole buffer.
        ("hierarchical", "2+1") if local_rank == 0 => 4 * n,
        ("hierarchical", "2+1") => 0,
        ("mpi", _) => 4 * n,
        other => panic!("no formula for {other:?}"),
    };
    assert_eq!(
        (moved.calls, moved.payload_bytes, moved.cross_host_bytes),
        (1, 4 * n as u64, want as u64),
        "{backend} {layout}: bytes across hosts"
    );
    // A small one (decoding's size) goes through each host's first rank in every layout.
    let n = 1000;
    let before = pg.stats();
    let mut v: Vec<f32> = (0..n).map(|i| (rank * n + i) as f32).collect();
    pg.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
    let exact = |i: usize| (0..world).map(|r| (r * n + i) as f32).sum::<f32>();
    assert!((0..n).all(|i| v[i] == exact(i)), "small all-reduce values");
    let moved = pg.stats().since(&before).get(CollectiveKind::AllReduce);
    let want = match (backend, layout) {
        ("shm", _) => 0,
        ("hierarchical", _) if local_rank == 0 => 4 * n,
        ("hierarchical", _) => 0,
        ("mpi", _) => 4 * n,
        other => panic!("no formula for {other:?}"),
    };
    assert_eq!(
        moved.cross_host_bytes, want as u64,
        "{backend} {layout}: bytes across hosts of a {n}-element all-reduce"
    );

    // Sub-groups: with --map-by node, even world ranks are on the first host, odd on the
    // second; on one host all are together.
    let split = |members: &[usize]| pg.new_group(members).unwrap();
    if world == 4 {
        let host_one = [0, 2];
        let pairs = [0, 1];
        let spread = [0, 1, 2];
        let kinds: [(&[usize], &str); 3] = match backend {
            "hierarchical" => [
                (&host_one, "shm"),
                (&pairs, "mpi"),
                (&spread, "hierarchical"),
            ],
            b => [(&host_one, b), (&pairs, b), (&spread, b)],
        };
        for (members, kind) in kinds {
            if let Some(g) = split(members) {
                assert_eq!(g.backend(), kind, "group {members:?}");
                let tag: Vec<String> = members.iter().map(|m| m.to_string()).collect();
                exercise(&g, members, &format!("group{}", tag.join("-")));
            }
        }
    }
    // Point-to-point across hosts (0 -> 1) and, at 4 ranks, inside one (0 -> 2).
    let peers: &[usize] = if world == 4 { &[1, 2] } else { &[1] };
    for &peer in peers {
        let payload: Vec<f32> = input(peer, 1000, 9);
        if rank == 0 {
            pg.send_slice(&payload, peer).unwrap();
        } else if rank == peer {
            let mut got = vec![0f32; 1000];
            pg.recv_slice(&mut got, 0).unwrap();
            assert_eq!(bits_f32(&got), bits_f32(&payload), "recv from 0 on {peer}");
        }
    }
    pg.barrier().unwrap();
    report("done", "ok");
}
