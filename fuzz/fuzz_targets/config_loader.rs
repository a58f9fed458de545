//! `config::Config::from_yaml` on arbitrary UTF-8 text.
//!
//! Invariants: never panics (nor overflows the stack, nor hangs: run with `-timeout`); a failed
//! load has at least one error and every error a non-empty message; a loaded config keeps the
//! cross-references validation promises; loading the same text twice gives the same answer.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = idemproxy_fuzz::check_config(text);
    }
});
