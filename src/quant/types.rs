//! Each ggml weight type described once: how the loader splits it, which product multiplies
//! it on the CPU, whether it has an f64-summing kernel. [`QuantMatMul`](super::QuantMatMul),
//! its f64 product and the GGUF loader all read this table, so that supporting a new type
//! (once its kernels exist in `candle-tp-kernels`) is one entry in [`TYPES`].

use candle_core::quantized::GgmlDType;
use candle_tp_kernels::repack::RepackFn;

/// Which product [`QuantMatMul`](super::QuantMatMul)'s `forward` runs for a weight on the CPU
/// (on other devices it is always candle's `QMatMul`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuProduct {
    /// Candle's `QMatMul`.
    Candle,
    /// The weight repacked four rows at a time when the matmul is built
    /// ([`QuantType::repack`]), every product summed in f64 (rounded to f32 by `forward`).
    Repacked,
}

/// Whether [`crate::quant::QuantMatMul::forward_f64`] has a kernel for weights of this type
/// ([`QuantType::sums_in_f64`]).
pub fn has_f64_kernel(dtype: GgmlDType) -> bool {
    QuantType::of(dtype).sums_in_f64()
}

/// How the crate handles weights of one ggml type.
#[derive(Debug, Clone, Copy)]
pub struct QuantType {
    /// The type.
    pub dtype: GgmlDType,
    /// A float type (F32, F16, BF16): the GGUF loader serves it as a dense tensor.
    pub dense: bool,
    /// The blocks a row-parallel split keeps together: 1, or 2 where candle's dot product
    /// needs an even number of blocks per row (Q5_0, Q5_1: the crate's kernels do not, but
    /// candle's `QMatMul` still multiplies these types off the CPU and under
    /// `CANDLE_DEQUANTIZE_ALL`). See [`QuantType::split_unit`].
    pub split_blocks: usize,
    /// The product of `QuantMatMul::forward` on the CPU.
    pub cpu_product: CpuProduct,
    /// Repacks GGUF bytes four rows at a time (`candle_tp_kernels::repack`), for
    /// [`CpuProduct::Repacked`].
    pub repack: Option<RepackFn>,
}

impl QuantType {
    /// A type multiplied by candle, split by `split_blocks` blocks.
    const fn candle(dtype: GgmlDType, split_blocks: usize) -> Self {
        Self {
            dtype,
            dense: false,
            split_blocks,
            cpu_product: CpuProduct::Candle,
            repack: None,
        }
    }

    /// A float type: served dense, multiplied by candle.
    const fn dense(dtype: GgmlDType) -> Self {
        Self {
            dense: true,
            ..Self::candle(dtype, 1)
        }
    }

    /// The entry of `dtype` in [`TYPES`]; a type not listed there is multiplied by candle and
    /// split by whole blocks.
    pub fn of(dtype: GgmlDType) -> Self {
        TYPES
            .iter()
            .find(|t| t.dtype == dtype)
            .copied()
            .unwrap_or(Self::candle(dtype, 1))
    }

    /// Whether the crate has an f64-summing kernel for the type (its repacked product,
    /// `QuantMatMul::forward_f64`, what row-parallel layers use).
    pub fn sums_in_f64(&self) -> bool {
        self.repack.is_some()
    }

    /// Values per block (1 for the float types).
    pub fn block_size(&self) -> usize {
        self.dtype.block_size()
    }

    /// The columns a row-parallel split of the type keeps together (`split_blocks` blocks).
    pub fn split_unit(&self) -> usize {
        self.split_blocks * self.block_size()
    }
}

/// Every type the crate treats differently from "candle multiplies it, split by blocks".
pub const TYPES: &[QuantType] = &[
    QuantType::dense(GgmlDType::F32),
    QuantType::dense(GgmlDType::F16),
    QuantType::dense(GgmlDType::BF16),
    QuantType {
        cpu_product: CpuProduct::Repacked,
        repack: Some(candle_tp_kernels::q4_0x4::repack),
        ..QuantType::candle(GgmlDType::Q4_0, 1)
    },
    QuantType {
        cpu_product: CpuProduct::Repacked,
        repack: Some(candle_tp_kernels::q4_1x4::repack),
        ..QuantType::candle(GgmlDType::Q4_1, 1)
    },
    QuantType {
        cpu_product: CpuProduct::Repacked,
        repack: Some(candle_tp_kernels::q5_0x4::repack),
        ..QuantType::candle(GgmlDType::Q5_0, 2)
    },
    QuantType {
        cpu_product: CpuProduct::Repacked,
        repack: Some(candle_tp_kernels::q5_1x4::repack),
        ..QuantType::candle(GgmlDType::Q5_1, 2)
    },
    QuantType {
        cpu_product: CpuProduct::Repacked,
        repack: Some(candle_tp_kernels::q8_0x4::repack),
        ..QuantType::candle(GgmlDType::Q8_0, 1)
    },
    QuantType {
        cpu_product: CpuProduct::Repacked,
        repack: Some(candle_tp_kernels::q4_kx4::repack),
        ..QuantType::candle(GgmlDType::Q4K, 1)
    },
    QuantType {
        cpu_product: CpuProduct::Repacked,
        repack: Some(candle_tp_kernels::q5_kx4::repack),
        ..QuantType::candle(GgmlDType::Q5K, 1)
    },
    QuantType {
        cpu_product: CpuProduct::Repacked,
        repack: Some(candle_tp_kernels::q6_kx4::repack),
        ..QuantType::candle(GgmlDType::Q6K, 1)
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_units() {
        for (dtype, unit) in [
            (GgmlDType::Q4_0, 32),
            (GgmlDType::Q4_1, 32),
            (GgmlDType::Q5_0, 64),
            (GgmlDType::Q5_1, 64),
            (GgmlDType::Q8_0, 32),
            (GgmlDType::Q2K, 256),
            (GgmlDType::Q6K, 256),
            (GgmlDType::F16, 1),
        ] {
            assert_eq!(QuantType::of(dtype).split_unit(), unit, "{dtype:?}");
        }
    }

    #[test]
    fn f64_kernels_and_dense_types() {
        let f64: Vec<_> = TYPES
            .iter()
            .filter(|t| t.sums_in_f64())
            .map(|t| t.dtype)
            .collect();
        assert_eq!(
            f64,
            [
                GgmlDType::Q4_0,
                GgmlDType::Q4_1,
                GgmlDType::Q5_0,
                GgmlDType::Q5_1,
                GgmlDType::Q8_0,
                GgmlDType::Q4K,
                GgmlDType::Q5K,
                GgmlDType::Q6K
            ]
        );
        assert!(QuantType::of(GgmlDType::BF16).dense);
        assert!(!QuantType::of(GgmlDType::Q4_0).dense);
    }
}
