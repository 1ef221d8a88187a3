//! [`RepackedMatMul`]: a repacked weight of any block type behind one object, with activations
//! prepared once for several weights of a type ([`PreparedActs`]), as candle-tp holds them.

use super::{Interleave, Prepared, Repacked};
use crate::kernel::Kernel;
use candle_core::Result;
use std::sync::Arc;

/// A repacked weight of any type, as `candle_tp::quant::QuantMatMul` holds it.
pub trait RepackedMatMul: Send + Sync + std::fmt::Debug {
    /// The block type's name (`Q4_0`).
    fn type_name(&self) -> &'static str;
    /// `(n, k)`.
    fn dims(&self) -> (usize, usize);
    /// [`Repacked::matmul_f64`].
    fn matmul_f64(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f64]) -> Result<()>;
    /// [`Repacked::matmul_f32`].
    fn matmul_f32(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f32]) -> Result<()>;
    /// [`Repacked::dequantize_row`].
    fn dequantize_row(&self, row: usize, out: &mut [f32]);
    /// [`Repacked::prepare`], for any weight of this block type.
    fn prepare(&self, kernel: Kernel, m: usize, x: &[f32]) -> Result<PreparedActs>;
    /// [`Repacked::matmul_prepared_f64`]; an error if `x` was prepared for another type.
    fn matmul_prepared_f64(&self, x: &PreparedActs, dst: &mut [f64]) -> Result<()>;
    /// [`Repacked::matmul_prepared_f32`]; an error if `x` was prepared for another type.
    fn matmul_prepared_f32(&self, x: &PreparedActs, dst: &mut [f32]) -> Result<()>;
}

/// [`Prepared`] activations of some block type, as [`RepackedMatMul::prepare`] gives them.
pub struct PreparedActs {
    type_name: &'static str,
    m: usize,
    k: usize,
    kernel: Kernel,
    inner: Box<dyn std::any::Any + Send + Sync>,
}

impl PreparedActs {
    /// The block type they were prepared for (`Q4_0`).
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }

    /// Activation rows.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The kernel they were prepared for.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    fn get<B: Interleave>(&self) -> Result<&Prepared<B>> {
        match self.inner.downcast_ref::<Prepared<B>>() {
            Some(x) => Ok(x),
            None => candle_core::bail!(
                "{} (repacked) matmul: activations prepared for {} weights",
                B::NAME,
                self.type_name
            ),
        }
    }
}

impl std::fmt::Debug for PreparedActs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PreparedActs({} rows x {} for {}, {:?})",
            self.m, self.k, self.type_name, self.kernel
        )
    }
}

impl<B: Interleave> RepackedMatMul for Repacked<B> {
    fn type_name(&self) -> &'static str {
        B::NAME
    }
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k())
    }
    fn matmul_f64(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f64]) -> Result<()> {
        Repacked::matmul_f64(self, kernel, m, x, dst)
    }
    fn matmul_f32(&self, kernel: Kernel, m: usize, x: &[f32], dst: &mut [f32]) -> Result<()> {
        Repacked::matmul_f32(self, kernel, m, x, dst)
    }
    fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        Repacked::dequantize_row(self, row, out)
    }
    fn prepare(&self, kernel: Kernel, m: usize, x: &[f32]) -> Result<PreparedActs> {
        let p = Repacked::prepare(self, kernel, m, x)?;
        Ok(PreparedActs {
            type_name: B::NAME,
            m: p.m,
            k: p.k,
            kernel,
            inner: Box::new(p),
        })
    }
    fn matmul_prepared_f64(&self, x: &PreparedActs, dst: &mut [f64]) -> Result<()> {
        Repacked::matmul_prepared_f64(self, x.get::<B>()?, dst)
    }
    fn matmul_prepared_f32(&self, x: &PreparedActs, dst: &mut [f32]) -> Result<()> {
        Repacked::matmul_prepared_f32(self, x.get::<B>()?, dst)
    }
}

/// Repacks a weight `[n, k]` given as GGUF bytes (a `QTensor`'s data) of blocks of `B`. Call
/// the block types' non-generic `repack` (e.g. [`crate::q4_0x4::repack`]) from other crates:
/// this generic would be instantiated there, with their optimisation level.
pub fn repack_bytes<B: Interleave>(
    bytes: &[u8],
    n: usize,
    k: usize,
) -> Result<Arc<dyn RepackedMatMul>> {
    let blocks = crate::f64_dot::blocks_from_bytes::<B>(bytes)?;
    Ok(Arc::new(Repacked::new(blocks, n, k)?))
}

/// The signature of [`repack_bytes`] for one block type.
pub type RepackFn = fn(&[u8], usize, usize) -> Result<Arc<dyn RepackedMatMul>>;
