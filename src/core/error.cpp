#include "core/error.hpp"

#include <cstdio>

namespace sparge {
namespace {
// A fixed buffer, not a std::string: setting the message never allocates, so
// fail() is safe inside a std::bad_alloc handler and cannot throw.
constexpr size_t kMessageBytes = 1024;
thread_local char g_last_error[kMessageBytes];
}  // namespace

sparge_status_t fail(sparge_status_t status, const char* fmt, ...) {
  char buf[kMessageBytes];  // formatted apart: an argument may point into g_last_error
  va_list ap;
  va_start(ap, fmt);
  const int n = std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  if (n < 0) buf[0] = '\0';
  std::snprintf(g_last_error, sizeof(g_last_error), "%s", buf);
  return status;
}

void clear_error() { g_last_error[0] = '\0'; }
const char* last_error_text() { return g_last_error; }

}  // namespace sparge
