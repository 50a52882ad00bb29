//! sessiond as a library: the gRPC services, their authentication, health
//! gating and startup wiring, for a Rust service that embeds sessiond
//! instead of running the `sessiond` binary beside it.
//!
//! - [`Sessiond`]: built from a [`config::Config`] (or its parts: a store,
//!   executor drivers of your own), yields the tonic [`Services`]
//!   (session, workspace, health, reflection) to mount in your router, and
//!   runs startup recovery and shutdown around them.
//! - [`serve`]: what `sessiond serve` does (its own listener, TLS, gRPC-web,
//!   bearer-token auth, metrics endpoint, signals).
//! - [`config`]: the validated configuration, and the loader the binary
//!   uses (TOML + `SESSIOND_*` + flags).
//!
//! To drive sessions from Rust without gRPC, [`Sessiond::manager`] (or
//! `sessiond-engine` alone) is the session manager the services call.
//!
//! Which crate for what: this one for the services and `serve`;
//! `sessiond-engine` (`SessionManager`) to drive sessions without gRPC;
//! `sessiond-executor` (the `Executor` trait) for a runtime of your own,
//! registered with [`SessiondBuilder::executor`]; `sessiond-store` for the
//! database; `sessiond-domain` for ids, entities, states and events;
//! `sessiond-proto` for a gRPC client. The guide is docs/EMBEDDING.md; the
//! examples are `examples/embed_tonic.rs` and `examples/custom_executor/`.

#![deny(missing_docs)]

mod api;
mod auth;
mod bounds;
pub mod config;
mod console;
mod convert;
mod cors;
mod embed;
mod error;
mod forward;
mod limits;
mod metrics;
mod replica;
mod serve;
mod waiting;

pub use api::Api;
pub use auth::AuthLayer;
pub use embed::{
    Error, ReflectionService, Result, Services, Sessiond, SessiondBuilder, inherited_agentctl_env,
};
pub use serve::{migrate, serve};
