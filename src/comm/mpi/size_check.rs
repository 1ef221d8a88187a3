//! Whether MPI collectives agree on their sizes first ([`CHECK_SIZES_VAR`]), the same on
//! every rank.

use std::sync::OnceLock;

use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;

use super::super::error::{CommError, CommResult};

/// Environment variable: `0` skips the agreement on sizes before each MPI collective that
/// does not carry it with its data (all but the all-reduces up to 64 KiB: one exchange of
/// a small header, a network round trip per step). Without it, ranks that disagree
/// get what MPI gives them (an MPI error, a hang until the watchdog's deadline, or wrong data),
/// as with NCCL or PyTorch's own backends; the default (`1`) checks.
pub const CHECK_SIZES_VAR: &str = "CANDLE_TP_MPI_CHECK";

/// Whether collectives agree on their sizes first: [`CHECK_SIZES_VAR`] as every rank agreed
/// on it when MPI was initialised ([`agree_on_check_sizes`]), else as this rank reads it.
static CHECK: OnceLock<bool> = OnceLock::new();

pub(super) fn check_sizes() -> bool {
    *CHECK.get_or_init(|| parse_check_sizes().unwrap_or(true))
}

/// [`CHECK_SIZES_VAR`]: unset, empty, `1`, `true` or `on` check; `0`, `false` or `off` do
/// not; anything else is an error naming the value.
fn parse_check_sizes() -> Result<bool, String> {
    let v = std::env::var(CHECK_SIZES_VAR).unwrap_or_default();
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "1" | "true" | "on" => Ok(true),
        "0" | "false" | "off" => Ok(false),
        _ => Err(format!("{v:?} is neither 0 nor 1")),
    }
}

/// Every rank's [`CHECK_SIZES_VAR`] compared at start (one all-reduce of the minimum and one of
/// the maximum over `world`): ranks that disagree would hang in their first collective (one
/// side sends a header the other does not expect), so a difference, or a value that is no
/// setting on any rank, is an error on every rank alike.
pub(super) fn agree_on_check_sizes(world: &SimpleCommunicator) -> CommResult<()> {
    use ::mpi::collective::SystemOperation;
    let mine = parse_check_sizes();
    let code: i32 = match mine {
        Ok(true) => 1,
        Ok(false) => 0,
        Err(_) => -1,
    };
    let (mut lo, mut hi) = (0i32, 0i32);
    world.all_reduce_into(&code, &mut lo, SystemOperation::min());
    world.all_reduce_into(&code, &mut hi, SystemOperation::max());
    if let Err(e) = mine {
        return Err(CommError::env(
            CHECK_SIZES_VAR,
            format!("on rank {}: {e}", world.rank()),
        ));
    }
    if lo < 0 {
        return Err(CommError::env(
            CHECK_SIZES_VAR,
            "another rank has a value that is neither 0 nor 1",
        ));
    }
    if lo != hi {
        return Err(CommError::env(
            CHECK_SIZES_VAR,
            format!(
                "differs between ranks (this rank, {}, has {}; set it alike on every rank, \
                 e.g. mpirun -x {CHECK_SIZES_VAR}=0)",
                world.rank(),
                code
            ),
        ));
    }
    let _ = CHECK.set(code == 1);
    Ok(())
}
