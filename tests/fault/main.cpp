// The one translation unit that provides Catch2's main().
#define CATCH_CONFIG_MAIN
#include "catch_compat.hpp"
