//! Vocabulary-parallel embedding and LM head (Megatron's `VocabParallelEmbedding`).
//!
//! The vocabulary rows are split across ranks (unevenly when needed). The embedding looks up
//! the ids that fall in this rank's rows, zeroes the others, and all-reduces; the LM head
//! produces this rank's slice of the logits, which samplers reduce without ever gathering the
//! full vocabulary. Both hold a [`ParallelWeight`]: from a GGUF file the rank's rows stay
//! quantized, the embedding dequantizes only the rows it looks up and a tied head multiplies
//! the same blocks.

use candle_core::{DType, Module, Result, Tensor};

use crate::comm::ProcessGroup;
use crate::loader::ShardedVarBuilder;
use crate::nn::ParallelWeight;
use crate::ops::{copy_to_tp, gather_from_tp, reduce_from_tp};
use crate::Partition;

/// An embedding table whose rows (token ids) are split across ranks.
#[derive(Debug, Clone)]
pub struct VocabParallelEmbedding {
    weight: ParallelWeight,
    dtype: DType,
    part: Partition,
    hidden: usize,
    pg: ProcessGroup,
    name: String,
}

impl VocabParallelEmbedding {
    /// From this rank's rows `[part.size(rank), hidden]` of the table.
    pub fn new(weight: Tensor, part: Partition, pg: ProcessGroup) -> Result<Self> {
        let dtype = weight.dtype();
        Self::from_weight(ParallelWeight::dense(weight, None), dtype, part, pg)
    }

    /// From this rank's rows as a dense or quantized [`ParallelWeight`]; lookups come out
    /// in `dtype`.
    pub fn from_weight(
        weight: ParallelWeight,
        dtype: DType,
        part: Partition,
        pg: ProcessGroup,
    ) -> Result<Self> {
        let (rows, hidden) = weight.dims()?;
        if part.parts() != pg.size() || rows != part.size(pg.rank()) {
            candle_core::bail!(
                "VocabParallelEmbedding: rank {} holds {rows} rows but its share of the vocabulary {} over {} ranks is {}",
                pg.rank(),
                part.total(),
                pg.size(),
                part.size(pg.rank().min(part.parts() - 1))
            );
        }
        Ok(Self {
            weight,
            dtype,
            part,
            hidden,
            pg,
            name: String::from("embedding"),
        })
    }

    /// From the full table `[vocab, hidden]`: every rank keeps its rows.
    pub fn from_dense(weight: &Tensor, pg: ProcessGroup) -> Result<Self> {
        let (vocab, _) = weight.dims2()?;
        let part = vocab_partition("VocabParallelEmbedding", vocab, &pg)?;
        let r = part.range(pg.rank());
        Self::new(weight.narrow(0, r.start, r.len())?, part, pg)
    }

    /// Loads this rank's rows of `weight` (`[vocab, hidden]`) from `vb`.
    pub fn load(vocab: usize, hidden: usize, vb: ShardedVarBuilder) -> Result<Self> {
        let pg = vb.pg().clone();
        let name = vb.full_name("weight");
        let part = vocab_partition(&format!("VocabParallelEmbedding '{name}'"), vocab, &pg)?;
        let w = vb.get_weight_sharded((vocab, hidden), "weight", 0, &part)?;
        let mut e = Self::from_weight(ParallelWeight::from_shard(w, None)?, vb.dtype(), part, pg)?;
        e.name = name;
        Ok(e)
    }

    /// This rank's rows of the table, dense (an error for a quantized table: see
    /// [`VocabParallelEmbedding::parallel_weight`]).
    pub fn weight(&self) -> Result<&Tensor> {
        self.weight.dense_weight()
    }

    /// This rank's rows of the table, dense or quantized.
    pub fn parallel_weight(&self) -> &ParallelWeight {
        &self.weight
    }

    /// How the vocabulary is split.
    pub fn partition(&self) -> &Partition {
        &self.part
    }

    /// Width of an embedding.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// The group the table is split over.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }
}

fn vocab_partition(layer: &str, vocab: usize, pg: &ProcessGroup) -> Result<Partition> {
    Partition::new(vocab, pg.size()).map_err(|e| {
        candle_core::Error::msg(format!(
            "{layer}: cannot split a vocabulary of {vocab} over {} ranks: {e}",
            pg.size()
        ))
    })
}

impl Module for VocabParallelEmbedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut out_dims = ids.dims().to_vec();
        out_dims.push(self.hidden);
        let flat: Vec<u32> = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1()?;
        let vocab = self.part.total();
        if let Some(bad) = flat.iter().find(|&&i| i as usize >= vocab) {
            candle_core::bail!(
                "{}: token id {bad} is outside the vocabulary of {vocab}",
                self.name
            );
        }
        let dev = &self.weight.device();
        if self.pg.size() == 1 {
            // Exactly candle_nn::Embedding.
            let idx = Tensor::from_vec(flat, ids.elem_count(), dev)?;
            return self.weight.rows(&idx, self.dtype)?.reshape(out_dims);
        }
        let range = self.part.range(self.pg.rank());
        let (local, mask): (Vec<u32>, Vec<u8>) = flat
            .iter()
            .map(|&i| {
                let i = i as usize;
                if range.contains(&i) {
                    ((i - range.start) as u32, 1)
                } else {
                    (0, 0)
                }
            })
            .unzip();
        let n = local.len();
        let idx = Tensor::from_vec(local, n, dev)?;
        // Foreign ids are zeroed by selection, not by multiplying row 0 by zero: Inf * 0 is
        // NaN, and the all-reduce would spread it to every rank.
        let rows = self.weight.rows(&idx, self.dtype)?;
        let keep = Tensor::from_vec(mask, (n, 1), dev)?.broadcast_as(rows.shape())?;
        let rows = keep.where_cond(&rows, &rows.zeros_like()?)?;
        reduce_from_tp(&rows.reshape(out_dims)?, &self.pg)
    }
}

/// The output projection onto the vocabulary, split by vocabulary rows like the embedding
/// (and sharing its weight when the model ties them). `forward` returns this rank's slice of
/// the logits; [`ParallelLmHead::forward_gathered`] the full logits.
#[derive(Debug, Clone)]
pub struct ParallelLmHead {
    weight: ParallelWeight,
    part: Partition,
    pg: ProcessGroup,
}

impl ParallelLmHead {
    /// Whether the head's product rows do not depend on the row count
    /// ([`ParallelWeight::rows_invariant`]).
    pub fn rows_invariant(&self) -> bool {
        self.weight.rows_invariant()
    }

    /// From this rank's rows `[part.size(rank), hidden]`.
    pub fn new(weight: Tensor, part: Partition, pg: ProcessGroup) -> Result<Self> {
        Self::from_weight(ParallelWeight::dense(weight, None), part, pg)
    }

    /// From this rank's rows as a dense or quantized [`ParallelWeight`].
    pub fn from_weight(weight: ParallelWeight, part: Partition, pg: ProcessGroup) -> Result<Self> {
        let (rows, _) = weight.dims()?;
        if part.parts() != pg.size() || rows != part.size(pg.rank()) {
            candle_core::bail!(
                "ParallelLmHead: rank {} holds {rows} rows, its share of the vocabulary of {} is {}",
                pg.rank(),
                part.total(),
                part.size(pg.rank().min(part.parts() - 1))
            );
        }
        Ok(Self { weight, part, pg })
    }

    /// The head tied to an embedding (`tie_word_embeddings`): the same shard, no copy.
    pub fn tied(embedding: &VocabParallelEmbedding) -> Self {
        Self {
            weight: embedding.weight.clone(),
            part: embedding.part,
            pg: embedding.pg.clone(),
        }
    }

    /// Loads this rank's rows of `weight` (`[vocab, hidden]`, e.g. `lm_head.weight`).
    pub fn load(hidden: usize, vocab: usize, vb: ShardedVarBuilder) -> Result<Self> {
        let pg = vb.pg().clone();
        let part = vocab_partition(
            &format!("ParallelLmHead '{}'", vb.full_name("weight")),
            vocab,
            &pg,
        )?;
        let w = vb.get_weight_sharded((vocab, hidden), "weight", 0, &part)?;
        Self::from_weight(ParallelWeight::from_shard(w, None)?, part, pg)
    }

    /// How the vocabulary is split.
    pub fn partition(&self) -> &Partition {
        &self.part
    }

    /// The group the vocabulary is split over.
    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Full logits (all-gathered): for tests and for callers that need every score.
    pub fn forward_gathered(&self, h: &Tensor) -> Result<Tensor> {
        gather_from_tp(&self.forward(h)?, &self.pg, &self.part)
    }
}

impl Module for ParallelLmHead {
    /// This rank's slice of the logits, `[..., part.size(rank)]`.
    fn forward(&self, h: &Tensor) -> Result<Tensor> {
        let h = copy_to_tp(h, &self.pg)?;
        self.weight.forward(&h)
    }
}
