//! sessiond-engine as users live it: real agentctl processes, the real
//! acp-demo-agent, SQLite and a real PostgreSQL. A backend restart is a
//! `shutdown()` of the manager (its tasks end, executors keep running) and a
//! new manager on the same store.
//!
//! Needs `cargo build -p agentctl -p acp-demo-agent` first.

#![allow(clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;
mod support;

/// The custom executor driver of sessiond-server's example, as a third
/// party writes one.
#[path = "../../../sessiond-server/examples/custom_executor/wrapper.rs"]
mod wrapper;

mod background;
mod claude;
mod containment;
mod crash;
mod custom_runtime;
mod db_outage;
mod docker_down;
mod docker_support;
mod docker_worktrees;
mod dropped_calls;
mod events;
mod heavy;
mod kill9;
mod lifecycle;
mod pending;
mod private_engine;
mod remote;
mod remote_worktrees;
mod restart;
mod resume;
mod turn_crash;
mod worktrees;
