//! The pure parts over many inputs: properties over generated inputs ([`generated`]) and what
//! the fuzz targets found ([`fuzz_regressions`]).

mod fuzz_regressions;
mod generated;
mod jsonrpc;
