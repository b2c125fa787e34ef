// Errors: MB_CHECK for the caller's mistakes, MB_ASSERT for our own broken invariants.
// The library never exits the process; it throws microbatch::Error (or a subclass).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

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
[[noreturn]] void throw_error(const std::string& msg);
[[noreturn]] void throw_assert(const char* cond, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace microbatch

/// Throws microbatch::Error with a fmt-formatted message when cond is false.
#define MB_CHECK(cond, ...)                                                  \
  do {                                                                       \
    if (!(cond)) ::microbatch::detail::throw_error(fmt::format(__VA_ARGS__)); \
  } while (0)

/// Throws on a broken internal invariant (a bug in microbatch, not the caller's mistake).
#define MB_ASSERT(cond, ...)                                                              \
  do {                                                                                    \
    if (!(cond))                                                                          \
      ::microbatch::detail::throw_assert(#cond, __FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)
