#include "core/error.hpp"

#include <cstdio>

namespace sparge {
namespace {
thread_local std::string g_last_error;
}

sparge_status_t fail(sparge_status_t status, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  g_last_error = buf;
  return status;
}

void clear_error() { g_last_error.clear(); }
const char* last_error_text() { return g_last_error.c_str(); }

}  // namespace sparge
