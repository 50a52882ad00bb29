//! Test support for sessiond. Never a dependency of production code.
//!
//! - [`postgres`]: a throwaway PostgreSQL cluster (or `DATABASE_URL`) and a
//!   fresh database per test.

pub mod postgres;
