// Entry point of the fault-injection tests (the same main() with Catch2 v2 and v3).
#define SPARGE_CATCH2_SESSION
#include "catch_compat.hpp"

int main(int argc, char** argv) { return Catch::Session().run(argc, argv); }
