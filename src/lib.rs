//! idemproxy
pub mod mock;
