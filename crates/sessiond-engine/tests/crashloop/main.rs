//! Crash tests of sessiond-engine with the backend in a child process
//! (this test binary re-executed, see `child.rs`) that dies by SIGKILL:
//!
//! - `failpoints.rs`: one test per crash point compiled into the library
//!   with the `failpoints` feature (`launch-after-intent`,
//!   `launch-after-spawn`, `recovery-after-reattach`, `recovery-after-ready`,
//!   `prompt-after-commit`, `reply-after-first-chunk`,
//!   `resume-after-intent`).
//!   The child is configured through `FAILPOINTS` (`name=kill` SIGKILLs the
//!   child at the first hit, `name=kill@N` at the Nth); the test asserts the
//!   point was hit, restarts cleanly and checks the world.
//! - `hooks.rs`: windows held open in process with the engine's test
//!   hooks, checked from a client's side.
//! - `crashloop.rs`: 20 sessions across the runtimes, the backend SIGKILLed
//!   at random 1.5-7.5 s intervals (some kills during recovery) for
//!   `SESSIOND_CRASHLOOP_SECS` (a short smoke run when unset), then a clean
//!   start and the same world checks.
//!
//! The world checks (`world.rs`) look at the world itself: the process table
//! (exactly one agentctl per live executor, pid + start time as recorded),
//! containers by label, the demo agent's transcripts against the stored
//! messages, gap-free event seqs, and the worktrees (every session's is
//! made from a repository, Docker's from one of the container user's):
//! none lost, none orphaned.
//!
//! Runtimes: standalone and remote (agentctls this test starts on loopback)
//! always; Docker when `SESSIOND_DOCKER_TESTS=1` (then an engine at
//! `DOCKER_HOST` and the image `sessiond-agentctl:dev` are required: a
//! missing one fails the test).
//!
//! This binary exists only with the `failpoints` feature:
//! `cargo build -p agentctl -p acp-demo-agent && cargo test -p sessiond-engine
//! --features failpoints --test crashloop`. `cargo xtask ci` runs it so.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

mod child;
#[path = "../common/mod.rs"]
mod common;
mod crashloop;
mod failpoints;
mod hooks;
mod world;
