// Catch2 v2 and v3 behind one include: every test file includes this header,
// never a Catch2 header directly. SPARGE_CATCH2_MAJOR (2 or 3) is defined by the
// sparge_catch2 CMake target (cmake/SpargeCatch2.cmake).
//
// The one file of a test program that defines main() defines SPARGE_CATCH2_SESSION
// before including this header: it then gets Catch::Session (and, with v2, the
// framework's implementation, CATCH_CONFIG_RUNNER).
//
// What the tests may use is what both versions spell the same: TEST_CASE,
// SECTION, REQUIRE/CHECK and their _FALSE/_NOTHROW/_THROWS forms, INFO,
// UNSCOPED_INFO, CAPTURE, WARN, FAIL, FAIL_CHECK, SUCCEED, Approx (Catch::Approx in
// v3, brought into the global namespace here as v2 has it) and Catch::Session.
#pragma once

#ifndef SPARGE_CATCH2_MAJOR
#error "SPARGE_CATCH2_MAJOR is not defined: build the tests through CMake (target sparge_catch2)"
#endif

#if SPARGE_CATCH2_MAJOR == 3
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#ifdef SPARGE_CATCH2_SESSION
#include <catch2/catch_session.hpp>
#endif
using Catch::Approx;
#elif SPARGE_CATCH2_MAJOR == 2
#ifdef SPARGE_CATCH2_SESSION
#define CATCH_CONFIG_RUNNER
#endif
#include <catch2/catch.hpp>
#else
#error "SPARGE_CATCH2_MAJOR must be 2 or 3"
#endif
