//! agentctl: the sidecar next to one agent.
//!
//! It serves `proto/agentctl/v1` ([`service::AgentCtl`]) to the backend,
//! authenticates every call with the executor's bearer secret
//! ([`auth`]), refuses calls of a sessiond replica whose lease was
//! superseded ([`fence`]), owns at most one agent process and speaks ACP to it
//! ([`agent`]), keeps a bounded, cursor-addressed log of agent updates
//! ([`updates`]), answers a recovering backend in one round trip
//! ([`recover`]) and offers shell, file and git access confined to the
//! workspace root ([`workspace`], [`exec`], [`git`]).
//!
//! Trust boundary: whoever holds the secret controls the agent and the
//! workspace; nothing reaches outside the workspace root through the file
//! calls, and the secret is never passed to the agent or to commands.

pub mod activity;
pub mod agent;
pub mod auth;
pub mod config;
pub mod elicit;
pub mod error;
pub mod exec;
pub mod fence;
pub mod git;
pub mod journal;
pub mod prompt;
pub mod recover;
pub mod service;
pub mod signs;
mod stdio;
pub mod sys;
pub mod terminal;
pub mod tree;
pub mod updates;
pub mod usage;
pub mod workspace;
pub mod worktree;
