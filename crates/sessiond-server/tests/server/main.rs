//! Integration tests of the `sessiond` binary: every RPC through a real tonic
//! client over loopback (with real agentctl and acp-demo-agent processes),
//! gRPC-web over HTTP/1.1, CORS, reflection, health around recovery,
//! authentication, configuration errors, metrics, traces (an in-test OTLP
//! receiver), interop with an agent on the Python ACP SDK.
//!
//! Needs `cargo build -p agentctl -p acp-demo-agent` first (`cargo xtask ci`
//! builds every binary before testing).

#![allow(clippy::unwrap_used)]

mod activity;
mod agents;
mod api;
mod attachments;
mod config;
mod database;
mod embedding;
mod fencing;
mod forwarding;
mod interop;
mod metrics;
mod ops;
mod permissions;
mod queued;
mod replica_crashloop;
mod replicas;
mod restart;
mod security;
mod serve;
mod support;
mod titles;
mod traces;
mod usage;
mod watch_many;
mod web;
mod worktrees;
