// Errors: MB_CHECK for the caller's mistakes, MB_ASSERT for our own broken invariants.
// The library never exits the process; it throws microbatch::Error (or a subclass).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

#if defined(__CUDACC__)
#include <sstream>
#else
#include <fmt/format.h>
#endif

namespace microbatch {

/// A caller's mistake or a failed operation; the message names the op and both sides.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// A request that would exceed a device's memory budget, or that the system refused.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& what, std::size_t requested)
      : Error(what), requested_(requested) {}
  std::size_t requested() const { return requested_; }

 private:
  std::size_t requested_;
};

namespace detail {
#if defined(__CUDACC__)
// nvcc cannot compile fmt's headers in C++20 mode, so CUDA sources format messages with this
// minimal substitute: each "{...}" is replaced by the next argument, streamed.
inline void format_into(std::ostringstream& os, std::string_view f) { os << f; }
template <class First, class... Rest>
void format_into(std::ostringstream& os, std::string_view f, const First& first, const Rest&... rest) {
  const auto open = f.find('{');
  const auto close = open == std::string_view::npos ? open : f.find('}', open);
  if (close == std::string_view::npos) {
    os << f;
    return;
  }
  os << f.substr(0, open) << first;
  format_into(os, f.substr(close + 1), rest...);
}
template <class... Args>
std::string format_runtime(std::string_view f, const Args&... args) {
  std::ostringstream os;
  format_into(os, f, args...);
  return os.str();
}
#endif
[[noreturn]] void throw_error(const std::string& msg);
[[noreturn]] void throw_assert(const char* cond, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace microbatch

#if defined(__CUDACC__)
#define MB_FORMAT(...) ::microbatch::detail::format_runtime(__VA_ARGS__)
#else
#define MB_FORMAT(...) fmt::format(__VA_ARGS__)
#endif

/// Throws microbatch::Error with a fmt-formatted message when cond is false.
#define MB_CHECK(cond, ...)                                                  \
  do {                                                                       \
    if (!(cond)) ::microbatch::detail::throw_error(MB_FORMAT(__VA_ARGS__));   \
  } while (0)

/// Throws on a broken internal invariant (a bug in microbatch, not the caller's mistake).
#define MB_ASSERT(cond, ...)                                                              \
  do {                                                                                    \
    if (!(cond))                                                                          \
      ::microbatch::detail::throw_assert(#cond, __FILE__, __LINE__, MB_FORMAT(__VA_ARGS__)); \
  } while (0)
