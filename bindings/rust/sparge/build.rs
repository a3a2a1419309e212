// Gives this crate's test and example binaries an rpath to the libsparge that
// sparge-sys linked (sparge-sys publishes its folder as DEP_SPARGE_LIB_DIR).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_SPARGE_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_SPARGE_LIB_DIR") {
        if std::env::var("CARGO_CFG_TARGET_FAMILY").map(|f| f == "unix").unwrap_or(false) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
