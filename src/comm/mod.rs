//! Process groups, collectives and their backends.
pub mod error;
pub use error::{CommError, CommResult};
