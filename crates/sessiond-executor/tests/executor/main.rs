//! Executor drivers against real agentctl processes, a real Docker engine and
//! loopback sockets. agentctl must be built (`cargo build --bins`, as
//! `cargo xtask ci` does). Docker tests run when `SESSIOND_DOCKER_TESTS=1`
//! and then fail, never skip, when the engine cannot be reached.

mod client;
mod docker;
mod remote;
mod standalone;
mod support;
