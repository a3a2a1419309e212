// Gives this crate's test and example binaries an rpath to the libsparge that
// sparge-sys linked (sparge-sys publishes its folder as DEP_SPARGE_LIB_DIR).
// A crate that depends on `sparge` does the same in its own build script to run
// without LD_LIBRARY_PATH:
//     if let Ok(dir) = std::env::var("DEP_SPARGE_LIB_DIR") {
//         println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
//     }
// (DEP_SPARGE_LIB_DIR reaches the build scripts of direct dependents of sparge-sys; `sparge`
// re-publishes it as DEP_SPARGE_RS_LIB_DIR for crates that depend on `sparge`.)
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_SPARGE_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_SPARGE_LIB_DIR") {
        println!("cargo:lib_dir={dir}");
        if std::env::var("CARGO_CFG_TARGET_FAMILY").map(|f| f == "unix").unwrap_or(false) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
