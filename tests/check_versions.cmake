# One version number: project(sparge VERSION ...) in CMakeLists.txt. The header's macros are checked
# at configure time; the Python package reads it (pyproject's regex provider, CMake-generated
# sparge/_version.py); the files below state it too and must agree (run by CTest with -DROOT=... -DVERSION=...).
cmake_minimum_required(VERSION 3.22)
string(REGEX MATCH "^([0-9]+)\\.([0-9]+)\\.([0-9]+)$" _ "${VERSION}")
set(maj ${CMAKE_MATCH_1})
set(min ${CMAKE_MATCH_2})
set(pat ${CMAKE_MATCH_3})
set(bad "")
function(expect file regex what)
  file(READ "${ROOT}/${file}" text)
  if(NOT text MATCHES "${regex}")
    list(APPEND bad "${file}: ${what} is not ${VERSION}")
    set(bad "${bad}" PARENT_SCOPE)
  endif()
endfunction()
expect(bindings/rust/Cargo.toml "\\[workspace\\.package\\]\nversion = \"${VERSION}\"" "workspace.package.version")
expect(bindings/rust/sparge/Cargo.toml "sparge-sys = { path = \"../sparge-sys\", version = \"${VERSION}\" }"
       "the sparge-sys dependency version")
expect(bindings/rust/Cargo.lock "name = \"sparge\"\nversion = \"${VERSION}\"" "the locked sparge version")
expect(bindings/rust/Cargo.lock "name = \"sparge-sys\"\nversion = \"${VERSION}\"" "the locked sparge-sys version")
expect(bindings/rust/sparge-sys/src/lib.rs
       "SPARGE_VERSION_MAJOR: c_int = ${maj};\npub const SPARGE_VERSION_MINOR: c_int = ${min};\npub const SPARGE_VERSION_PATCH: c_int = ${pat};"
       "SPARGE_VERSION_MAJOR/MINOR/PATCH")
expect(CMakeLists.txt "project\\(sparge VERSION ${VERSION} " "the project() line bindings/python/pyproject.toml's regex reads")
expect(bindings/python/pyproject.toml "regex = 'project\\\\\\(sparge VERSION " "the version regex")
expect(bindings/python/pyproject.toml "dynamic = \\[\"version\"\\]" "dynamic (from CMake)")
if(bad)
  string(REPLACE ";" "\n  " bad "${bad}")
  message(FATAL_ERROR "version ${VERSION} (CMakeLists.txt) is not stated consistently:\n  ${bad}")
endif()
message(STATUS "version ${VERSION}: Rust crates, Cargo.lock, sparge-sys constants and the Python build agree")
