//! Vocabulary-parallel embedding and LM head against candle-nn's dense layers.

mod common;

use candle_core::{Device, Module, Tensor};
use candle_nn::{Embedding, Linear};
use candle_tp::{run_threads, ParallelLmHead, Partition, VocabParallelEmbedding};
use common::{max_abs_diff, seeded, var};

#[test]
fn embedding_and_tied_head_match_dense_for_1_to_4_ranks() {
    let (vocab, hidden) = (11, 6); // 11 rows: uneven over 2, 3, 4 ranks
    let table = seeded(&[vocab, hidden], 1);
    let ids = Tensor::new(&[[0u32, 10, 3, 3], [7, 1, 5, 9]], &Device::Cpu).unwrap();
    let probe = seeded(&[2, 4, hidden], 2);
    let logit_probe = seeded(&[2, 4, vocab], 3);
    for world in 1..=4 {
        run_threads(world, |pg| {
            let rank = pg.rank();
            let part = Partition::new(vocab, world)?;
            let r = part.range(rank);
            // Dense: embedding, then tied head; loss touches both.
            let wd = var(&table);
            let emb = Embedding::new(wd.as_tensor().clone(), hidden).forward(&ids)?;
            let logits = Linear::new(wd.as_tensor().clone(), None).forward(&emb)?;
            let loss = ((&emb * &probe)?.sum_all()? + (&logits * &logit_probe)?.sum_all()?)?;
            let gd = loss.backward()?;
            // Parallel.
            let wp = var(&table.narrow(0, r.start, r.len())?);
            let e = VocabParallelEmbedding::new(wp.as_tensor().clone(), part, pg.clone())?;
            let head = ParallelLmHead::tied(&e);
            let emb_p = e.forward(&ids)?;
            let local_logits = head.forward(&emb_p)?;
            assert_eq!(local_logits.dims(), &[2, 4, r.len()]);
            let full_logits = head.forward_gathered(&emb_p)?;
            let lp = logit_probe.narrow(2, r.start, r.len())?;
            let loss_p = ((&emb_p * &probe)?.sum_all()? + (&local_logits * &lp)?.sum_all()?)?;
            let gp = loss_p.backward()?;
            assert!(
                max_abs_diff(&emb_p, &emb)? <= 1e-6,
                "embedding, world {world}"
            );
            assert!(
                max_abs_diff(&full_logits, &logits)? <= 1e-5,
                "logits, world {world}"
            );
            let g_want = gd.get(&wd).unwrap().narrow(0, r.start, r.len())?;
            let d = max_abs_diff(gp.get(&wp).unwrap(), &g_want)?;
            assert!(d <= 1e-5, "weight gradient, world {world} rank {rank}: {d}");
            if world == 1 {
                // Bit-identical to candle-nn with one rank.
                assert_eq!(
                    emb_p.flatten_all()?.to_vec1::<f32>()?,
                    emb.flatten_all()?.to_vec1::<f32>()?
                );
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn out_of_vocabulary_ids_are_a_clear_error() {
    let table = seeded(&[5, 2], 1);
    let e = run_threads(2, |pg| {
        let emb = VocabParallelEmbedding::from_dense(&table, pg)?;
        emb.forward(&Tensor::new(&[1u32, 5], &Device::Cpu)?)?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("token id 5 is outside the vocabulary of 5"),
        "{e}"
    );
}

/// A non-finite value in a local row 0 must not leak into other ranks' tokens: foreign ids
/// are zeroed by selection, not by multiplying row 0 by zero (`Inf * 0 = NaN`, which the
/// all-reduce then spreads to every rank). Only the token whose own row holds the Inf may be
/// non-finite, exactly as in the dense embedding; its gradient is checked too.
#[test]
fn an_inf_in_a_local_row_0_stays_in_its_own_token() {
    let (vocab, hidden) = (11, 6);
    let mut data = seeded(&[vocab, hidden], 1)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    // Local row 0 of a rank: row 6 at world 2 (6 + 5) and 4 (3 + 3 + 3 + 2), row 8 at world
    // 3 (4 + 4 + 3). Neither id is looked up below.
    for row in [6usize, 8] {
        data[row * hidden + 2] = f32::INFINITY;
    }
    let table = Tensor::from_vec(data, (vocab, hidden), &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[0u32, 10, 3, 3], [7, 1, 5, 9]], &Device::Cpu).unwrap();
    for world in 2..=4 {
        run_threads(world, |pg| {
            let part = Partition::new(vocab, world)?;
            let r = part.range(pg.rank());
            let dense = Embedding::new(table.clone(), hidden).forward(&ids)?;
            let wp = var(&table.narrow(0, r.start, r.len())?);
            let e = VocabParallelEmbedding::new(wp.as_tensor().clone(), part, pg.clone())?;
            let got = e.forward(&ids)?;
            let err = max_abs_diff(&got, &dense)?; // errors on any NaN/Inf
            assert!(err <= 1e-6, "world {world}: {err}");
            let g = got.sum_all()?.backward()?;
            common::assert_finite("embedding gradient", g.get(&wp).unwrap())?;
            Ok(())
        })
        .unwrap();
    }
}
