// Finds libsparge: $SPARGE_LIB_DIR if set, else the repository's build folder
// (bindings/rust/../../build). Links it dynamically and records an rpath for
// this crate's own test binaries. Dependents receive the folder as
// DEP_SPARGE_LIB_DIR (this crate declares `links = "sparge"`).
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=SPARGE_LIB_DIR");
    println!("cargo:rerun-if-changed=build.rs");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let dir = match env::var("SPARGE_LIB_DIR") {
        Ok(d) if !d.is_empty() => PathBuf::from(d),
        _ => manifest.join("../../../build"),
    };
    let dir = dir.canonicalize().unwrap_or(dir);
    let found = ["libsparge.so", "libsparge.dylib", "sparge.lib"].iter().any(|f| dir.join(f).exists());
    if !found {
        println!(
            "cargo:warning=libsparge not found in {} (build it with scripts/build.sh, or set SPARGE_LIB_DIR)",
            dir.display()
        );
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=dylib=sparge");
    println!("cargo:lib_dir={}", dir.display());
    if env::var("CARGO_CFG_TARGET_FAMILY").map(|f| f == "unix").unwrap_or(false) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
}
