//! The model families a GGUF file can hold, as llama.cpp names them (`general.architecture`),
//! and what each one means for the Hugging Face side: the architecture of its `config.json`,
//! where its feed-forward tensors live, and whether llama.cpp permuted its q/k rows.
//!
//! | GGUF architecture            | Hugging Face architecture | feed-forward                          |
//! |------------------------------|---------------------------|---------------------------------------|
//! | `llama`                      | `LlamaForCausalLM`        | `mlp.{gate,up,down}_proj`             |
//! | `llama` with `expert_count`  | `MixtralForCausalLM`      | `block_sparse_moe.experts.N.{w1,w3,w2}` |
//! | `qwen3`                      | `Qwen3ForCausalLM`        | `mlp.{gate,up,down}_proj`             |
//! | `qwen3moe`                   | `Qwen3MoeForCausalLM`     | `mlp.experts.N.{gate,up,down}_proj`   |
//!
//! A mixture-of-experts layer stores its experts either as one 3-D tensor per projection
//! (`ffn_gate_exps`, `[experts, rows, cols]`, what llama.cpp writes today) or, in Mixtral files
//! written before that, as one matrix per expert (`ffn_gate.N`). Either maps onto the Hugging
//! Face names of single experts, so the same model code loads both.

/// A model family of a GGUF file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufFamily {
    /// `llama` without experts.
    Llama,
    /// `llama` with `llama.expert_count` > 0.
    Mixtral,
    /// `qwen3`: Llama plus a per-head RmsNorm of queries and keys, no q/k permutation.
    Qwen3,
    /// `qwen3moe`: Qwen3 with a sparse mixture of experts in every layer.
    Qwen3Moe,
}

/// The experts of a mixture-of-experts family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgufExperts {
    /// `{arch}.expert_count`.
    pub count: usize,
    /// `{arch}.expert_used_count` (top-k).
    pub used: usize,
    /// One expert's width: `{arch}.expert_feed_forward_length`, or for Mixtral
    /// `llama.feed_forward_length`.
    pub intermediate_size: usize,
}

impl GgufFamily {
    /// The family of `general.architecture` = `arch` with `experts` experts per layer, `None`
    /// for architectures the crate does not read.
    pub fn of(arch: &str, experts: usize) -> Option<Self> {
        match (arch, experts) {
            ("llama", 0) => Some(Self::Llama),
            ("llama", _) => Some(Self::Mixtral),
            ("qwen3", 0) => Some(Self::Qwen3),
            ("qwen3moe", _) => Some(Self::Qwen3Moe),
            _ => None,
        }
    }

    /// The architectures [`GgufFamily::of`] reads.
    pub const ARCHITECTURES: [&'static str; 3] = ["llama", "qwen3", "qwen3moe"];

    /// `general.architecture`, the prefix of the family's metadata keys.
    pub fn arch(self) -> &'static str {
        match self {
            Self::Llama | Self::Mixtral => "llama",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3moe",
        }
    }

    /// The Hugging Face `architectures` entry.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// The Hugging Face `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mixtral => "mixtral",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3_moe",
        }
    }

    /// Whether the layers are sparse mixtures of experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Self::Mixtral | Self::Qwen3Moe)
    }

    /// Whether the attention normalises queries and keys per head (`attn_q_norm`,
    /// `attn_k_norm`).
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Self::Qwen3 | Self::Qwen3Moe)
    }

    /// Whether llama.cpp's converter permuted the q/k rows into its interleaved rotary order
    /// (the `llama` architecture; Qwen's use the half-split order Hugging Face has).
    pub fn rotary_permuted(self) -> bool {
        matches!(self, Self::Llama | Self::Mixtral)
    }

    /// Where the layer's feed-forward lives under `model.layers.N`.
    pub fn feed_forward(self) -> &'static str {
        match self {
            Self::Mixtral => "block_sparse_moe",
            _ => "mlp",
        }
    }

    /// The Hugging Face names of one expert's gate, up and down projections.
    pub fn expert_projections(self) -> [&'static str; 3] {
        match self {
            Self::Mixtral => ["w1", "w3", "w2"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        }
    }
}
