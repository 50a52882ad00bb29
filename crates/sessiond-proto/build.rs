//! Compiles the crate's `proto/` with a vendored protoc, so `cargo build`
//! needs no setup (and the packaged crate builds from its own files).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("proto");
    let protos = [
        "agentctl/v1/agentctl.proto",
        "sessiond/v1/types.proto",
        "sessiond/v1/events.proto",
        "sessiond/v1/session_service.proto",
        "sessiond/v1/workspace_service.proto",
    ];
    println!("cargo:rerun-if-changed={}", root.display());
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: the build script is single-threaded; prost-build reads PROTOC.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PROTOC", protoc);
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .build_client(std::env::var_os("CARGO_FEATURE_CLIENT").is_some())
        .build_server(std::env::var_os("CARGO_FEATURE_SERVER").is_some())
        .file_descriptor_set_path(out_dir.join("descriptor.bin"))
        .compile_protos(&protos.map(|p| root.join(p)), std::slice::from_ref(&root))?;
    Ok(())
}
