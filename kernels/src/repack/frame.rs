//! [`Aligned`], a value on a 64-byte boundary, and [`realign_frame!`], which puts the kernel
//! that writes it on a 64-byte aligned stack frame.
//!
//! The 512-bit engines keep more vectors live than there are registers (eight activation rows'
//! accumulators beside the weights), so LLVM spills zmm values to the stack. The stack is only
//! 16-byte aligned, so it spills them with unaligned moves, and where the caller's stack depth
//! puts the spill slots across cache lines every spill and reload is split. Measured on a Zen 5
//! core: the same machine code of `k4_quad_dot` (Q4_K, 5632 x 2048, 16 activation rows) ran
//! 1.17x slower after an unrelated change to its caller (the AMX branches of the driver) moved
//! its frame by 32 bytes; with a 64-byte aligned local the frame is realigned and it ran as
//! before (803 against 816-865 µs, against 949-963 unaligned).

/// A 64-byte aligned value.
#[repr(C, align(64))]
pub struct Aligned<T>(pub T);

/// `realign_frame!()`: a 64-byte aligned local that the optimiser keeps, so that the function
/// it is written in gets a 64-byte aligned stack frame (see the module's documentation).
macro_rules! realign_frame {
    () => {
        let frame = $crate::repack::frame::Aligned([0u8; 64]);
        std::hint::black_box(&frame);
    };
}
pub(crate) use realign_frame;
