//! Point-to-point `send` / `recv`: slices of every element type between ranks of the shared-
//! memory engine (threads), errors instead of hangs, and the tensor ops' autograd: a pipeline
//! of 2 and 3 stages gives the loss and every gradient of the same model run in one process.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_tp::comm::{run_threads, run_threads_with, GroupOptions, ProcessGroup};
use candle_tp::ops::{recv, send};

/// Each rank sends `n` values to the next rank and receives from the previous (even ranks
/// send first, odd ranks receive first, so no cycle of waiting sends), in type `T`.
fn ring<T>(world: usize, n: usize, make: fn(f64) -> T) -> Result<()>
where
    T: candle_tp::comm::Element + PartialEq + std::fmt::Debug,
{
    let got = run_threads(world, |pg| {
        let r = pg.rank();
        let (next, prev) = ((r + 1) % world, (r + world - 1) % world);
        let mine: Vec<T> = (0..n).map(|i| make((r * 1000 + i) as f64)).collect();
        let mut from_prev = vec![T::default(); n];
        if r % 2 == 0 {
            pg.send_slice(&mine, next)?;
            pg.recv_slice(&mut from_prev, prev)?;
        } else {
            pg.recv_slice(&mut from_prev, prev)?;
            pg.send_slice(&mine, next)?;
        }
        Ok(from_prev)
    })?;
    for (r, v) in got.iter().enumerate() {
        let prev = (r + world - 1) % world;
        let want: Vec<T> = (0..n).map(|i| make((prev * 1000 + i) as f64)).collect();
        assert_eq!(v, &want, "world {world}: rank {r} from rank {prev}");
    }
    Ok(())
}

#[test]
fn slices_of_every_type_reach_their_peer() -> Result<()> {
    for world in [2, 3, 4] {
        // 1 element, one slot's worth of f32 (4 MiB) and more: several chunks.
        for n in [1, 1000, (4 << 20) / 4 + 17] {
            ring::<f32>(world, n, |v| v as f32)?;
        }
        ring::<f64>(world, 33, |v| v * 0.5)?;
        ring::<half::bf16>(world, 33, half::bf16::from_f64)?;
        ring::<half::f16>(world, 33, |v| half::f16::from_f64(v / 16.0))?;
        ring::<i64>(world, 33, |v| -(v as i64))?;
        ring::<u8>(world, 33, |v| v as u8)?;
    }
    Ok(())
}

#[test]
fn bad_peers_and_sizes_are_errors_not_hangs() -> Result<()> {
    let opts = GroupOptions {
        timeout: std::time::Duration::from_secs(20),
        ..GroupOptions::default()
    };
    let errs = run_threads_with(2, opts, |pg| {
        let self_err = pg.send_slice(&[1f32], pg.rank()).unwrap_err().to_string();
        let range_err = pg.recv_slice(&mut [0f32], 7).unwrap_err().to_string();
        // Sizes that disagree: both sides get an error from the transfer's agreement check.
        let t0 = std::time::Instant::now();
        let mismatch = if pg.rank() == 0 {
            pg.send_slice(&[1f32, 2.0, 3.0], 1)
        } else {
            pg.recv_slice(&mut [0f32; 2], 0)
        }
        .unwrap_err()
        .to_string();
        Ok((self_err, range_err, mismatch, t0.elapsed()))
    })?;
    for (r, (self_err, range_err, mismatch, took)) in errs.iter().enumerate() {
        assert!(self_err.contains("is this rank itself"), "{self_err}");
        assert!(range_err.contains("peer 7 is not a rank"), "{range_err}");
        // Both sides' counts, each with its rank (a bare '2' is in any message about a
        // group of 2).
        assert!(
            mismatch.contains("rank 0 called broadcast with 3 f32 elements")
                && mismatch.contains("rank 1 called broadcast with 2 f32 elements"),
            "rank {r}: {mismatch}"
        );
        assert!(took.as_secs() < 10, "rank {r}: the mismatch took {took:?}");
    }
    Ok(())
}

#[test]
fn a_peer_that_fails_ends_the_transfer_naming_it() {
    let t0 = std::time::Instant::now();
    let err = run_threads(2, |pg| {
        if pg.rank() == 1 {
            candle_core::bail!("stage 1 could not load its layers");
        }
        let mut buf = [0f32; 4];
        pg.recv_slice(&mut buf, 1)?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("stage 1 could not load"), "{err}");
    assert!(t0.elapsed().as_secs() < 10, "took {:?}", t0.elapsed());
}

/// The model: `x` → tanh(x W0ᵀ) → tanh(· W1ᵀ) → · W2ᵀ → L = Σ y² / 2, stage `s` owning `Ws`
/// (2 stages: stage 1 owns W1 and W2).
fn weights() -> Vec<Tensor> {
    vec![
        common::seeded(&[8, 6], 1),
        common::seeded(&[8, 8], 2),
        common::seeded(&[4, 8], 3),
    ]
}

fn layer(h: &Tensor, w: &Tensor, last: bool) -> candle_core::Result<Tensor> {
    let y = h.matmul(&w.t()?)?;
    if last {
        Ok(y)
    } else {
        y.tanh()
    }
}

/// The dense run in one process: the loss and the gradients of W0, W1, W2.
fn dense(x: &Tensor) -> Result<(f32, Vec<Tensor>)> {
    let vars: Vec<Var> = weights().iter().map(common::var).collect();
    let mut h = x.clone();
    for (i, w) in vars.iter().enumerate() {
        h = layer(&h, w.as_tensor(), i == 2)?;
    }
    let loss = (h.sqr()?.sum_all()? * 0.5)?;
    let g = loss.backward()?;
    let grads = vars.iter().map(|v| g.get(v).unwrap().clone()).collect();
    Ok((loss.to_scalar::<f32>()?, grads))
}

/// Layers `owned` of the model on this stage, with `send`/`recv` between stages; returns the
/// loss (last stage) and this stage's gradients.
fn stage(
    pg: &ProcessGroup,
    x: &Tensor,
    owned: &[usize],
) -> candle_core::Result<(f32, Vec<(usize, Tensor)>)> {
    let (s, last) = (pg.rank(), pg.rank() + 1 == pg.size());
    let vars: Vec<Var> = owned.iter().map(|&i| common::var(&weights()[i])).collect();
    let mut h = if s == 0 {
        x.clone()
    } else {
        let in_dim = weights()[owned[0]].dim(1)?;
        recv(
            &[x.dim(0)?, in_dim],
            DType::F32,
            &Device::Cpu,
            pg,
            s - 1,
            true,
        )?
    };
    for (&i, w) in owned.iter().zip(&vars) {
        h = layer(&h, w.as_tensor(), i == 2)?;
    }
    let (loss, g) = if last {
        let loss = (h.sqr()?.sum_all()? * 0.5)?;
        (loss.to_scalar::<f32>()?, loss.backward()?)
    } else {
        (f32::NAN, send(&h, pg, s + 1)?.backward()?)
    };
    let grads = owned
        .iter()
        .zip(&vars)
        .map(|(&i, v)| (i, g.get(v).expect("a gradient").clone()))
        .collect();
    Ok((loss, grads))
}

#[test]
fn pipeline_stages_give_the_dense_loss_and_gradients() -> Result<()> {
    let x = common::seeded(&[5, 6], 9);
    let (want_loss, want) = dense(&x)?;
    assert!(want_loss.is_finite() && want_loss > 0.1, "{want_loss}");
    for layout in [vec![vec![0], vec![1, 2]], vec![vec![0], vec![1], vec![2]]] {
        let out = run_threads(layout.len(), |pg| stage(&pg, &x, &layout[pg.rank()]))?;
        let loss = out.last().unwrap().0;
        assert!(
            (loss - want_loss).abs() <= 1e-5 * want_loss,
            "{} stages: loss {loss} against {want_loss}",
            layout.len()
        );
        for (_, grads) in &out {
            for (i, g) in grads {
                let d = common::max_abs_diff(g, &want[*i])?;
                assert!(
                    d <= 1e-5,
                    "{} stages: W{i} gradient off by {d}",
                    layout.len()
                );
            }
        }
    }
    Ok(())
}

#[test]
fn inference_transfers_keep_dtype_and_shape() -> Result<()> {
    let out = run_threads(2, |pg| {
        let t = Tensor::arange(0f32, 12.0, &Device::Cpu)?
            .reshape((3, 4))?
            .to_dtype(DType::BF16)?;
        if pg.rank() == 0 {
            let h = send(&t, &pg, 1)?;
            assert_eq!(h.dims(), &[] as &[usize]);
            Ok(t)
        } else {
            recv(&[3, 4], DType::BF16, &Device::Cpu, &pg, 0, false)
        }
    })?;
    assert_eq!(out[1].dtype(), DType::BF16);
    assert_eq!(common::max_abs_diff(&out[0], &out[1])?, 0.0);
    Ok(())
}

/// Issue 44, defect 7: two tensors of one shape sent to one peer were matched in order only,
/// so transfers (or their gradients) taken in different orders by the two ranks swapped
/// silently. Now every transfer and its gradient carry a tag: the loss L = Σ 3a + Σ 5b gives
/// ∂L/∂a = 3 and ∂L/∂b = 5 back at rank 0, and a receiver that asks for tag 1 where tag 0
/// comes fails, naming both tags, instead of taking the wrong tensor.
#[test]
fn tagged_transfers_keep_their_gradients_and_misorders_are_errors() -> Result<()> {
    let grads = run_threads(2, |pg| {
        if pg.rank() == 0 {
            let a = Var::new(&[1f32, 2.0], &Device::Cpu)?;
            let b = Var::new(&[10f32, 20.0], &Device::Cpu)?;
            let ha = candle_tp::ops::send_tagged(a.as_tensor(), &pg, 1, 0)?;
            let hb = candle_tp::ops::send_tagged(b.as_tensor(), &pg, 1, 1)?;
            // One backward over both handles: Candle picks the order of the two receives.
            let g = (ha + hb)?.backward()?;
            Ok(vec![
                g.get(a.as_tensor()).expect("∂a").to_vec1::<f32>()?,
                g.get(b.as_tensor()).expect("∂b").to_vec1::<f32>()?,
            ])
        } else {
            let a = candle_tp::ops::recv_tagged(&[2], DType::F32, &Device::Cpu, &pg, 0, true, 0)?;
            let b = candle_tp::ops::recv_tagged(&[2], DType::F32, &Device::Cpu, &pg, 0, true, 1)?;
            ((a * 3.0)?.sum_all()? + (b * 5.0)?.sum_all()?)?.backward()?;
            Ok(vec![])
        }
    })?;
    assert_eq!(grads[0], vec![vec![3.0, 3.0], vec![5.0, 5.0]]);

    let errs = run_threads_with(
        2,
        GroupOptions {
            timeout: std::time::Duration::from_secs(5),
            ..GroupOptions::default()
        },
        |pg| {
            if pg.rank() == 0 {
                let x = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
                candle_tp::ops::send_tagged(&x, &pg, 1, 0)?;
                candle_tp::ops::send_tagged(&x, &pg, 1, 1)?;
                Ok(String::new())
            } else {
                let e =
                    candle_tp::ops::recv_tagged(&[2], DType::F32, &Device::Cpu, &pg, 0, false, 1)
                        .unwrap_err()
                        .to_string();
                // The second transfer still arrives: drain it so that rank 0 finishes.
                let _ =
                    candle_tp::ops::recv_tagged(&[2], DType::F32, &Device::Cpu, &pg, 0, false, 1);
                Ok(e)
            }
        },
    )?;
    assert!(
        errs[1].contains("tag 1") && errs[1].contains("of tag 0"),
        "{}",
        errs[1]
    );
    Ok(())
}

/// Issue 44, defect 7: a stage sends a tensor that tracks no gradient (a frozen first stage)
/// to a `recv(grad = true)`: the receiver's backward sent a gradient nobody received, and the
/// next transfer between the two ranks read it in its place (or the pair waited out its
/// deadline). Now the receiver sends none, and the next transfer is the one that was sent.
#[test]
fn a_sender_without_gradients_gets_none_back() -> Result<()> {
    let got = run_threads(2, |pg| {
        if pg.rank() == 0 {
            let x = Tensor::new(&[1f32, 2.0], &Device::Cpu)?; // no gradient
            send(&x, &pg, 1)?;
            send(&Tensor::new(&[7f32, 8.0], &Device::Cpu)?, &pg, 1)?;
            Ok(vec![])
        } else {
            let x = recv(&[2], DType::F32, &Device::Cpu, &pg, 0, true)?;
            (x * 2.0)?.sum_all()?.backward()?;
            recv(&[2], DType::F32, &Device::Cpu, &pg, 0, false)?.to_vec1::<f32>()
        }
    })?;
    assert_eq!(got[1], vec![7.0, 8.0]);
    Ok(())
}
