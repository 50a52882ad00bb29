//! Executor drivers against real agentctl processes, a real Docker engine and
//! loopback sockets. agentctl must be built (`cargo build --bins`, as
//! `cargo xtask ci` does). The Docker tests are `#[ignore]`d and run by
//! `cargo xtask ci` (nextest `--run-ignored all`) with an engine; they fail,
//! never skip, when the engine cannot be reached.

mod client;
mod docker;
mod remote;
mod standalone;
mod support;
