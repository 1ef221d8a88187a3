//! Constrained decoding on vocabulary shards: a grammar (structured outputs, forced tool
//! calls) decides which tokens a sequence may draw next, and every rank masks its own slice of
//! the logits with that decision.
//!
//! Rank 0 alone holds the grammar (a [`TokenFilter`]: it needs the tokenizer, which the other
//! ranks never load). At each step it computes the allowed set of every constrained row as a
//! bitset over the whole vocabulary (`vocab / 32` words, 6 KiB for 49152 tokens) and
//! broadcasts all of them in one collective ([`share_masks`]); each rank then sets the logits
//! of the disallowed ids of its shard to minus infinity ([`mask_shard`]) before penalties'
//! effects reach the sampler, so a masked token cannot be drawn by greedy, Gumbel-race or
//! top-k / top-p sampling (they all skip -inf). One source of truth, hence no chance of ranks
//! disagreeing, and no grammar work repeated on every rank; the price is one broadcast of a
//! few KiB per step with constrained rows.
//!
//! Rank 0 also commits each drawn token to its filter. A filter that fails, or allows no token
//! at all, fails its sequence alone: the broadcast carries a status word per row, every rank
//! drops the row from the step, and rank 0 keeps the message for the request.

use std::ops::Range;

use candle_core::Result;

use crate::comm::ProcessGroup;

/// Which tokens a sequence may draw next (a grammar). Held by rank 0 only.
pub trait TokenFilter: Send + std::fmt::Debug {
    /// Sets the bit of every id the sequence may draw next in `allowed` (bit `id % 32` of word
    /// `id / 32`, one bit per id of the model's vocabulary; every word is zero on entry).
    /// End-of-sequence ids are allowed only where the grammar is complete.
    fn allowed(&mut self, allowed: &mut [u32]) -> Result<()>;
    /// Advances past the drawn `token`.
    fn commit(&mut self, token: u32) -> Result<()>;
}

/// One row's shared mask: the allowed ids as a bitset, or why rank 0's grammar failed.
pub type RowMask = std::result::Result<Vec<u32>, String>;

/// Words of a bitset over `vocab` ids.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Whether `id` is set in `bits`.
pub fn is_allowed(bits: &[u32], id: usize) -> bool {
    bits.get(id / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// One constrained row of a step, on rank 0: its filter, and the stop ids it may not draw yet
/// (`min_tokens` not reached) unless the grammar allows nothing else.
pub struct MaskRequest<'a> {
    /// The sequence's grammar (`None` on ranks other than 0).
    pub filter: Option<&'a mut (dyn TokenFilter + 'static)>,
    /// Stop ids masked too while the grammar allows another token.
    pub hold_back: &'a [u32],
}

/// Every rank's copy of the constrained rows' allowed sets: `Ok(bits)` per row, or `Err` with
/// why rank 0's filter failed (its message on rank 0, a generic one elsewhere). Every rank
/// passes the same number of rows (a row's filter is read on rank 0 only); one broadcast.
pub fn share_masks(
    rows: &mut [MaskRequest<'_>],
    vocab: usize,
    pg: &ProcessGroup,
) -> Result<Vec<RowMask>> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let words = mask_words(vocab);
    let stride = 1 + words;
    let mut buf = vec![0u32; rows.len() * stride];
    let mut why: Vec<Option<String>> = vec![None; rows.len()];
    if pg.rank() == 0 {
        for (k, row) in rows.iter_mut().enumerate() {
            let chunk = &mut buf[k * stride..(k + 1) * stride];
            let (status, bits) = chunk.split_at_mut(1);
            let got = match row.filter.as_deref_mut() {
                Some(f) => f.allowed(bits).map_err(|e| e.to_string()),
                None => Err("rank 0 holds no grammar for this sequence".to_string()),
            };
            let got = got.and_then(|()| {
                // Bits past the vocabulary (a tokenizer with more tokens) cannot be drawn.
                if !vocab.is_multiple_of(32) {
                    bits[words - 1] &= (1u32 << (vocab % 32)) - 1;
                }
                if !bits.iter().any(|&w| w != 0) {
                    return Err("the grammar allows no token".to_string());
                }
                hold_back(bits, row.hold_back);
                Ok(())
            });
            if let Err(e) = got {
                status[0] = 1;
                bits.fill(0);
                why[k] = Some(e);
            }
        }
    }
    pg.broadcast_slice(&mut buf, 0)?;
    Ok(buf
        .chunks_exact(stride)
        .zip(why)
        .map(|(chunk, why)| match chunk[0] {
            0 => Ok(chunk[1..].to_vec()),
            _ => Err(why.unwrap_or_else(|| "the grammar failed on rank 0".to_string())),
        })
        .collect())
}

/// Clears the `ids` in `bits` unless that leaves no id set.
fn hold_back(bits: &mut [u32], ids: &[u32]) {
    if ids.is_empty() {
        return;
    }
    let mut rest = bits.to_vec();
    for &id in ids {
        let id = id as usize;
        if let Some(w) = rest.get_mut(id / 32) {
            *w &= !(1u32 << (id % 32));
        }
    }
    if rest.iter().any(|&w| w != 0) {
        bits.copy_from_slice(&rest);
    }
}

/// Sets the logits of the ids of `range` (this rank's shard, held by `local`) that `bits` does
/// not allow to minus infinity.
pub fn mask_shard(local: &mut [f32], range: Range<usize>, bits: &[u32]) {
    for (i, v) in local.iter_mut().enumerate() {
        if !is_allowed(bits, range.start + i) {
            *v = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holding_back_keeps_the_only_choice() {
        let mut bits = vec![0b1010u32, 0];
        hold_back(&mut bits, &[1]);
        assert_eq!(bits, [0b1000, 0]);
        let mut only_stop = vec![0b10u32, 0];
        hold_back(&mut only_stop, &[1]);
        assert_eq!(only_stop, [0b10, 0]);
        let mut v = vec![0.5f32; 5];
        mask_shard(&mut v, 32..37, &[0, 0b10100]);
        let kept: Vec<bool> = v.iter().map(|x| x.is_finite()).collect();
        assert_eq!(
            kept,
            [false, false, true, false, true],
            "ids 34 and 36 stay"
        );
    }
}
