//! What a user writes and runs: the command line, the configuration file and the deployment
//! files.
//!
//! - [`commands`] — the `idemproxy` binary's commands, flags, exit codes and logs.
//! - [`config`] — the configuration file — every refusal with its field path, the defaults,
//!   `config.example.yaml`; [`config::bounds`]: values out of bounds and cross-field rules.
//! - [`deploy`] — `Dockerfile`, `.dockerignore` and `deploy/`.

mod commands;
mod config;
mod deploy;
