//! All-to-all (issue 45, item 1): `ProcessGroup::all_to_all_v_slice` and the differentiable
//! `ops::all_to_all`, against references built here from every rank's inputs (not by the code
//! under test), on the threads backend (the shm engine that processes run: its native
//! exchange, which moves each block once, checked by the group's counters against the
//! off-rank blocks), and the all-gather fallback that backends without their own all-to-all
//! (the hierarchical one) run. Across processes, `tests/mpirun.rs` runs MPI's
//! (`MPI_Alltoallv`); across hosts, `tests/hosts_collectives.rs` runs the same check on shm,
//! MPI and hierarchical groups.

use candle_core::{DType, Device, Tensor, Var};
use candle_tp::comm::{
    run_threads, run_threads_with, CollectiveKind, CommError, GroupOptions, ProcessGroup,
};

/// Elements rank `s` sends rank `d` in layout `layout` (zeros included).
fn count(layout: usize, p: usize, s: usize, d: usize) -> usize {
    match layout {
        0 => 1,
        1 => (s * 7 + d * 3 + layout) % 5,
        2 => (s + 1) * 1000 + d * 17,
        _ => usize::from(s == 0) * (d + 1) * 3 + p,
    }
}

/// Rank `s`'s input value at index `i`: differs per rank and index, exact in every dtype
/// tested (small integers).
fn value(s: usize, i: usize) -> f64 {
    ((s * 131 + i * 7) % 97) as f64
}

/// What rank `r` must receive: block `s` is rank `s`'s values at the offset of `r`'s block.
fn expected(layout: usize, p: usize, r: usize) -> Vec<f64> {
    let mut want = Vec::new();
    for s in 0..p {
        let at: usize = (0..r).map(|d| count(layout, p, s, d)).sum();
        want.extend((at..at + count(layout, p, s, r)).map(|i| value(s, i)));
    }
    want
}

fn exchange<T: candle_tp::comm::Element>(
    pg: &ProcessGroup,
    layout: usize,
    from: impl Fn(f64) -> T,
) -> candle_tp::comm::CommResult<Vec<T>> {
    exchange_by(pg, layout, from, false)
}

/// [`exchange`] through the backend's own all-to-all, or (`fallback`) through the all-gather
/// of every rank's whole buffer that backends without one run.
fn exchange_by<T: candle_tp::comm::Element>(
    pg: &ProcessGroup,
    layout: usize,
    from: impl Fn(f64) -> T,
    fallback: bool,
) -> candle_tp::comm::CommResult<Vec<T>> {
    let (p, me) = (pg.size(), pg.rank());
    let send: Vec<usize> = (0..p).map(|d| count(layout, p, me, d)).collect();
    let recv: Vec<usize> = (0..p).map(|s| count(layout, p, s, me)).collect();
    let src: Vec<T> = (0..send.iter().sum()).map(|i| from(value(me, i))).collect();
    let mut dst = vec![T::default(); recv.iter().sum()];
    if fallback {
        pg.all_to_all_v_slice_via_all_gather(&src, &send, &mut dst, &recv)?;
    } else {
        pg.all_to_all_v_slice(&src, &send, &mut dst, &recv)?;
    }
    Ok(dst)
}

/// Every element type a collective carries, exchanged in `layout`, as f64 for comparison
/// (all values are small integers, exact in each).
fn every_dtype(
    pg: &ProcessGroup,
    layout: usize,
    fallback: bool,
) -> candle_tp::comm::CommResult<Vec<(&'static str, Vec<f64>)>> {
    use half::{bf16, f16};
    let back = |v: Vec<f64>| v;
    Ok(vec![
        (
            "f32",
            exchange_by(pg, layout, |v| v as f32, fallback)?
                .into_iter()
                .map(f64::from)
                .collect(),
        ),
        ("f64", back(exchange_by(pg, layout, |v| v, fallback)?)),
        (
            "f16",
            exchange_by(pg, layout, f16::from_f64, fallback)?
                .iter()
                .map(|v| v.to_f64())
                .collect(),
        ),
        (
            "bf16",
            exchange_by(pg, layout, bf16::from_f64, fallback)?
                .iter()
                .map(|v| v.to_f64())
                .collect(),
        ),
        (
            "u8",
            exchange_by(pg, layout, |v| v as u8, fallback)?
                .into_iter()
                .map(f64::from)
                .collect(),
        ),
        (
            "u32",
            exchange_by(pg, layout, |v| v as u32, fallback)?
                .into_iter()
                .map(f64::from)
                .collect(),
        ),
        (
            "i16",
            exchange_by(pg, layout, |v| v as i16 - 40, fallback)?
                .into_iter()
                .map(|v| f64::from(v) + 40.0)
                .collect(),
        ),
        (
            "i32",
            exchange_by(pg, layout, |v| v as i32 - 40, fallback)?
                .into_iter()
                .map(|v| f64::from(v) + 40.0)
                .collect(),
        ),
        (
            "i64",
            exchange_by(pg, layout, |v| v as i64 - 40, fallback)?
                .into_iter()
                .map(|v| v as f64 + 40.0)
                .collect(),
        ),
    ])
}

#[test]
fn every_rank_receives_its_blocks_in_every_dtype_and_layout() {
    for fallback in [false, true] {
        for p in 1..=4 {
            for layout in 0..4 {
                let got = run_threads(p, |pg| Ok(every_dtype(&pg, layout, fallback)?)).unwrap();
                for (r, dtypes) in got.into_iter().enumerate() {
                    let want = expected(layout, p, r);
                    assert_eq!(dtypes.len(), 9, "every Element type");
                    for (dtype, v) in dtypes {
                        assert_eq!(
                            v, want,
                            "{dtype}, {p} ranks, layout {layout}, rank {r}, fallback {fallback}"
                        );
                    }
                }
            }
        }
    }
}

/// Bytes of every block rank `me` sends to another rank, and receives from one, in `layout`.
fn off_rank_bytes(layout: usize, p: usize, me: usize, esz: usize) -> (u64, u64) {
    let sent: usize = (0..p)
        .filter(|&d| d != me)
        .map(|d| count(layout, p, me, d))
        .sum();
    let recv: usize = (0..p)
        .filter(|&s| s != me)
        .map(|s| count(layout, p, s, me))
        .sum();
    ((sent * esz) as u64, (recv * esz) as u64)
}

#[test]
fn the_native_exchange_moves_each_off_rank_block_once() {
    // Layout 2 (thousands of elements per pair) and 1 (zeros included), at 3 and 4 ranks, with
    // the default slots and with 1 KiB slots (many phases): what the all-to-all counted is the
    // off-rank blocks, and the only all-gather is the size agreement (2p sizes per rank).
    for slot_bytes in [4 << 20, 1024] {
        let options = GroupOptions {
            slot_bytes,
            ..GroupOptions::default()
        };
        for p in [3, 4] {
            for layout in [1, 2] {
                let got = run_threads_with(p, options, |pg| {
                    let before = pg.stats();
                    let v = exchange(&pg, layout, |v| v as f32)?;
                    Ok((v, pg.stats().since(&before)))
                })
                .unwrap();
                for (r, (v, stats)) in got.into_iter().enumerate() {
                    let what =
                        format!("{p} ranks, layout {layout}, {slot_bytes}-byte slots, rank {r}");
                    let want: Vec<f32> = expected(layout, p, r).iter().map(|&v| v as f32).collect();
                    assert_eq!(v, want, "{what}");
                    let a2a = stats.get(CollectiveKind::AllToAll);
                    let (sent, recv) = off_rank_bytes(layout, p, r, 4);
                    assert_eq!(a2a.calls, 1, "{what}");
                    assert_eq!(a2a.sent_bytes, sent, "bytes sent, {what}");
                    assert_eq!(a2a.received_bytes, recv, "bytes received, {what}");
                    let sizes = stats.get(CollectiveKind::AllGather);
                    assert_eq!(sizes.calls, 1, "{what}");
                    assert_eq!(
                        sizes.sent_bytes,
                        (2 * p * 8) as u64,
                        "size agreement, {what}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_fallback_moves_every_send_buffer_to_every_rank() {
    // What the native exchange replaces (and what backends without one still run): each
    // rank's whole send buffer reaches every peer, p - 1 times the native volume in all.
    let p = 4;
    let got = run_threads(p, |pg| {
        let before = pg.stats();
        let v = exchange_by(&pg, 2, |v| v as f32, true)?;
        Ok((v, pg.stats().since(&before)))
    })
    .unwrap();
    let moved: u64 = (0..p)
        .map(|s| (0..p).map(|d| count(2, p, s, d) * 4).sum::<usize>() as u64)
        .sum();
    for (r, (v, stats)) in got.into_iter().enumerate() {
        let want: Vec<f32> = expected(2, p, r).iter().map(|&v| v as f32).collect();
        assert_eq!(v, want, "rank {r}");
        assert_eq!(stats.get(CollectiveKind::AllToAll).calls, 0);
        let mine: usize = (0..p).map(|d| count(2, p, r, d) * 4).sum();
        let gathered = stats.get(CollectiveKind::AllGather).received_bytes;
        // The size agreement, then every peer's whole buffer.
        assert_eq!(
            gathered,
            (3 * 2 * p * 8) as u64 + moved - mine as u64,
            "rank {r}"
        );
    }
}

#[test]
fn one_rank_with_more_than_a_slot_to_send_while_the_others_send_nothing() {
    // Rank 0 sends 3000 f64 to each peer (24 KB, 23 slots of 1 KiB), the others send nothing
    // but a block to themselves: every rank runs the same phases, the receivers read only.
    let options = GroupOptions {
        slot_bytes: 1024,
        ..GroupOptions::default()
    };
    let p = 3;
    let n = |s: usize, d: usize| {
        if s == 0 {
            3000 + d
        } else {
            usize::from(s == d) * 5
        }
    };
    let got = run_threads_with(p, options, |pg| {
        let me = pg.rank();
        let send: Vec<usize> = (0..p).map(|d| n(me, d)).collect();
        let recv: Vec<usize> = (0..p).map(|s| n(s, me)).collect();
        let src: Vec<f64> = (0..send.iter().sum()).map(|i| value(me, i)).collect();
        let mut dst = vec![0f64; recv.iter().sum()];
        pg.all_to_all_v_slice(&src, &send, &mut dst, &recv)?;
        Ok(dst)
    })
    .unwrap();
    for (r, v) in got.into_iter().enumerate() {
        let mut want = Vec::new();
        for s in 0..p {
            let at: usize = (0..r).map(|d| n(s, d)).sum();
            want.extend((at..at + n(s, r)).map(|i| value(s, i)));
        }
        assert_eq!(v, want, "rank {r}");
    }
}

#[test]
fn element_types_that_differ_are_an_error_on_every_rank_and_the_group_goes_on() {
    // The sizes agree, the element types do not: the exchange's first phase compares them.
    let got = run_threads(3, |pg| {
        let me = pg.rank();
        let e = if me == 1 {
            let mut dst = vec![0f64; 3];
            pg.all_to_all_v_slice(&[1f64; 3], &[1, 1, 1], &mut dst, &[1, 1, 1])
        } else {
            let mut dst = vec![0f32; 3];
            pg.all_to_all_v_slice(&[1f32; 3], &[1, 1, 1], &mut dst, &[1, 1, 1])
        }
        .expect_err("dtypes differ");
        let again = exchange(&pg, 3, |v| v as i32)?;
        Ok((e, again))
    })
    .unwrap();
    for (r, (e, again)) in got.into_iter().enumerate() {
        match &e {
            CommError::Mismatch { op, detail, .. } => {
                assert_eq!(op, "all_to_all", "rank {r}");
                assert!(
                    detail.contains("rank 1 called all_to_all") && detail.contains("f64"),
                    "rank {r}: {detail}"
                );
            }
            other => panic!("rank {r}: {other}"),
        }
        let want: Vec<i32> = expected(3, 3, r).iter().map(|&v| v as i32).collect();
        assert_eq!(again, want, "rank {r} after the error");
    }
}

#[test]
fn blocks_larger_than_a_slot_go_in_chunks() {
    // Layout 2 moves thousands of f64 per pair; slots of 1 KiB (the least) cut them in chunks.
    let options = GroupOptions {
        slot_bytes: 1024,
        ..GroupOptions::default()
    };
    let got = run_threads_with(3, options, |pg| Ok(exchange(&pg, 2, |v| v)?)).unwrap();
    for (r, v) in got.iter().enumerate() {
        assert!(v.len() > 3000, "rank {r} got {} values", v.len());
        assert_eq!(*v, expected(2, 3, r), "rank {r}");
    }
}

#[test]
fn sizes_that_disagree_are_the_same_error_on_every_rank_and_the_group_goes_on() {
    let got = run_threads(3, |pg| {
        let me = pg.rank();
        // Rank 1 expects 2 elements from rank 2, which sends 1.
        let send = vec![1usize; 3];
        let mut recv = vec![1usize; 3];
        if me == 1 {
            recv[2] = 2;
        }
        let mut dst = vec![0f32; recv.iter().sum()];
        let err = pg
            .all_to_all_v_slice(&[me as f32; 3], &send, &mut dst, &recv)
            .expect_err("sizes disagree");
        // The same group then runs a good one.
        let again = exchange(&pg, 1, |v| v as f32)?;
        Ok((err, again))
    })
    .unwrap();
    for (r, (err, again)) in got.into_iter().enumerate() {
        match &err {
            CommError::Mismatch { op, detail, .. } => {
                assert_eq!(op, "all_to_all");
                assert!(
                    detail.contains("rank 2 sends 1 elements to rank 1, which expects 2"),
                    "rank {r}: {detail}"
                );
            }
            other => panic!("rank {r}: {other}"),
        }
        let want: Vec<f32> = expected(1, 3, r).iter().map(|&v| v as f32).collect();
        assert_eq!(again, want, "rank {r} after the error");
    }
}

#[test]
fn a_bad_buffer_on_one_rank_fails_every_rank_at_once() {
    let options = GroupOptions {
        timeout: std::time::Duration::from_secs(60),
        ..GroupOptions::default()
    };
    let start = std::time::Instant::now();
    let errs = run_threads_with(2, options, |pg| {
        // Rank 0's input holds 3 elements where its sizes send 2.
        let n = if pg.rank() == 0 { 3 } else { 2 };
        let mut dst = vec![0f32; 2];
        let e = pg
            .all_to_all_v_slice(&vec![0f32; n], &[1, 1], &mut dst, &[1, 1])
            .expect_err("rank 0's buffer is wrong");
        Ok(e.to_string())
    })
    .unwrap();
    assert!(
        start.elapsed().as_secs() < 30,
        "waited {:?}",
        start.elapsed()
    );
    assert!(
        errs[0].contains("send sizes [1, 1] for an input of 3 elements"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].contains("rank 0"),
        "rank 1 names the rank that failed: {}",
        errs[1]
    );
}

/// `y` of every rank as one tensor: the rows each rank received, rank after rank, built from
/// the concatenated inputs by index (the dense computation the distributed one must equal).
fn dense_output(xs: &[Tensor], send: &[Vec<usize>]) -> candle_core::Result<Tensor> {
    let p = xs.len();
    let mut rows = Vec::new();
    for r in 0..p {
        for (s, x) in xs.iter().enumerate() {
            let at: usize = send[s][..r].iter().sum();
            rows.push(x.narrow(0, at, send[s][r])?);
        }
    }
    Tensor::cat(&rows, 0)
}

#[test]
fn gradients_equal_the_dense_computation_and_finite_differences() {
    let p = 3;
    let cols = 4;
    // Rows rank s sends rank d (one pair sends none).
    let send: Vec<Vec<usize>> = (0..p)
        .map(|s| (0..p).map(|d| (s + 2 * d + 1) % 4).collect())
        .collect();
    let x_of = |s: usize| -> candle_core::Result<Tensor> {
        let n: usize = send[s].iter().sum();
        let v: Vec<f64> = (0..n * cols)
            .map(|i| ((s * 37 + i * 11) % 23) as f64 / 7.0 - 1.5)
            .collect();
        Tensor::from_vec(v, (n, cols), &Device::Cpu)
    };
    // The loss of every rank: sum(w ⊙ y²), w fixed per rank; the job's loss is their sum.
    let w_of = |r: usize, rows: usize| -> candle_core::Result<Tensor> {
        let v: Vec<f64> = (0..rows * cols)
            .map(|i| ((r + i * 5) % 7) as f64 - 3.0)
            .collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu)
    };
    let recv_of = |r: usize| -> Vec<usize> { (0..p).map(|s| send[s][r]).collect() };
    // Distributed: each rank's gradient of the job's loss with respect to its own rows, and the
    // job's loss at small perturbations of chosen elements (central differences).
    let eps = 1e-6;
    let probes: Vec<(usize, usize)> = vec![(0, 0), (1, 5), (2, 3), (0, 9)];
    let run = |perturb: Option<(usize, usize, f64)>| {
        run_threads(p, |pg| {
            let r = pg.rank();
            let mut x = x_of(r)?;
            if let Some((rank, i, d)) = perturb {
                if rank == r {
                    let mut v = x.flatten_all()?.to_vec1::<f64>()?;
                    v[i] += d;
                    x = Tensor::from_vec(v, x.dims(), &Device::Cpu)?;
                }
            }
            let x = Var::from_tensor(&x)?;
            let y = candle_tp::ops::all_to_all(x.as_tensor(), &pg, &send[r], &recv_of(r))?;
            let loss = (w_of(r, y.dim(0)?)? * y.sqr()?)?.sum_all()?;
            let grads = loss.backward()?;
            let g = grads.get(x.as_tensor()).expect("gradient of x").clone();
            let total = pg.all_reduce(&loss.reshape(1)?, candle_tp::comm::ReduceOp::Sum)?;
            Ok((total.to_vec1::<f64>()?[0], g))
        })
    };
    let base = run(None).unwrap();
    // Dense: the same loss on one process, every rank's rows in one tensor.
    let xs: Vec<Var> = (0..p)
        .map(|s| Var::from_tensor(&x_of(s).unwrap()).unwrap())
        .collect();
    let ts: Vec<Tensor> = xs.iter().map(|v| v.as_tensor().clone()).collect();
    let y = dense_output(&ts, &send).unwrap();
    let w = Tensor::cat(
        &(0..p)
            .map(|r| w_of(r, recv_of(r).iter().sum()).unwrap())
            .collect::<Vec<_>>(),
        0,
    )
    .unwrap();
    let loss = (w * y.sqr().unwrap()).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let dense_loss = loss.to_scalar::<f64>().unwrap();
    for (r, (total, g)) in base.iter().enumerate() {
        assert!(total.is_finite() && dense_loss.is_finite());
        assert!(
            (total - dense_loss).abs() <= 1e-9 * dense_loss.abs().max(1.0),
            "loss {total} vs {dense_loss}"
        );
        let want = grads.get(xs[r].as_tensor()).expect("dense gradient");
        let diff = (g - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        let finite = g
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite());
        assert!(
            finite && diff <= 1e-12,
            "rank {r}: gradient differs from the dense one by {diff}"
        );
        assert_eq!(g.dtype(), DType::F64);
    }
    for &(rank, i) in &probes {
        let plus = run(Some((rank, i, eps))).unwrap()[0].0;
        let minus = run(Some((rank, i, -eps))).unwrap()[0].0;
        let fd = (plus - minus) / (2.0 * eps);
        let g = base[rank]
            .1
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()[i];
        assert!(fd.is_finite() && g.is_finite());
        assert!(
            (fd - g).abs() <= 1e-5 * g.abs().max(1.0),
            "rank {rank} element {i}: autograd {g}, finite difference {fd}"
        );
    }
}

#[test]
fn the_tensor_op_refuses_rows_that_do_not_add_up_naming_the_shape() {
    let errs = run_threads(2, |pg| {
        let x = Tensor::zeros((3, 2), DType::F32, &Device::Cpu)?;
        // Both ranks send 1 + 1 rows from a tensor of 3.
        let e = candle_tp::ops::all_to_all(&x, &pg, &[1, 1], &[1, 1]).expect_err("3 rows");
        Ok(e.to_string())
    })
    .unwrap();
    assert!(
        errs.iter()
            .any(|e| e.contains("tensor has 3 rows (shape [3, 2])")),
        "{errs:?}"
    );
}
