//! Process groups, collectives and their backends.
pub mod error;
pub mod store;
pub use error::{CommError, CommResult};
