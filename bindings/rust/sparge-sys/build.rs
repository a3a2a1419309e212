// Finds libsparge, in order:
//   1. $SPARGE_LIB_DIR (a folder holding libsparge.so);
//   2. pkg-config (`pkg-config --variable=libdir sparge`, honouring PKG_CONFIG_PATH), i.e. an
//      installed libsparge (cmake --install);
//   3. the repository's build folder (bindings/rust/../../build).
// Links it dynamically and records an rpath to that folder for this crate's own test binaries.
// Dependents receive the folder as DEP_SPARGE_LIB_DIR (this crate declares `links = "sparge"`):
// a dependent's build script can add `cargo:rustc-link-arg=-Wl,-rpath,<dir>` for its own
// binaries; otherwise they find the library at run time through the system loader
// (LD_LIBRARY_PATH, or an install in a folder ldconfig knows). Cargo does not pass link
// arguments of a dependency's build script on to the dependent's binaries.
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn pkg_config_libdir() -> Option<PathBuf> {
    let pc = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".to_string());
    let out = Command::new(pc).args(["--variable=libdir", "sparge"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = String::from_utf8(out.stdout).ok()?.trim().to_string();
    if dir.is_empty() {
        None
    } else {
        Some(PathBuf::from(dir))
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=SPARGE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG");
    println!("cargo:rerun-if-changed=build.rs");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let (dir, how) = match env::var("SPARGE_LIB_DIR") {
        Ok(d) if !d.is_empty() => (PathBuf::from(d), "SPARGE_LIB_DIR"),
        _ => match pkg_config_libdir() {
            Some(d) => (d, "pkg-config"),
            None => (manifest.join("../../../build"), "the repository's build folder"),
        },
    };
    let dir = dir.canonicalize().unwrap_or(dir);
    let found = ["libsparge.so", "libsparge.dylib", "sparge.lib"].iter().any(|f| dir.join(f).exists());
    if !found {
        println!(
            "cargo:warning=libsparge not found in {} (from {}); build it with scripts/build.sh, install it \
             (pkg-config), or set SPARGE_LIB_DIR",
            dir.display(),
            how
        );
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=dylib=sparge");
    println!("cargo:lib_dir={}", dir.display());
    if env::var("CARGO_CFG_TARGET_FAMILY").map(|f| f == "unix").unwrap_or(false) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
}
