//! Test support for sessiond. Never a dependency of production code.
//!
//! - [`postgres`]: a throwaway PostgreSQL cluster (or `DATABASE_URL`) and a
//!   fresh database per test.
//! - [`claude`]: the Claude Code ACP adapter run offline against a fake
//!   Anthropic Messages API.
//! - [`dockerd`]: a private Docker engine the way these machines allow.

pub mod claude;
pub mod dockerd;
pub mod postgres;
