fn main() {
    // The migrations are embedded with `embed_migrations!`; rebuild when they change.
    println!("cargo:rerun-if-changed=migrations");
}
