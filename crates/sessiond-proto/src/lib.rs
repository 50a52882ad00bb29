//! Wire contracts of sessiond, generated from `proto/` by `build.rs`.
//!
//! `agentctl::v1` is the backend <-> sidecar contract; `sessiond::v1` is the
//! public API. Client and server stubs are behind the `client` and `server`
//! features. [`FILE_DESCRIPTOR_SET`] feeds server reflection.

#![allow(missing_debug_implementations, clippy::all)]

pub mod agentctl {
    pub mod v1 {
        tonic::include_proto!("agentctl.v1");
    }
}

pub mod sessiond {
    pub mod v1 {
        tonic::include_proto!("sessiond.v1");
    }
}

/// Encoded descriptors of every service, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("descriptor");
