// Thread-local last-error text and the status helpers every layer uses.
#pragma once
#include <cstdarg>
#include <string>

#include "sparge/sparge.h"

namespace sparge {

// Sets the thread-local message (printf-style) and returns `status`, so that
// `return fail(SPARGE_ERR_INVALID_ARGUMENT, "q: ...");` reads naturally.
sparge_status_t fail(sparge_status_t status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

void clear_error();
const char* last_error_text();

}  // namespace sparge

// Propagate a non-OK status (the message is already set).
#define SPARGE_TRY(expr)                         \
  do {                                           \
    sparge_status_t sparge_try_st_ = (expr);     \
    if (sparge_try_st_ != SPARGE_OK) return sparge_try_st_; \
  } while (0)
