#include "core/error.h"

namespace microbatch::detail {

void throw_error(const std::string& msg) { throw Error(msg); }

void throw_assert(const char* cond, const char* file, int line, const std::string& msg) {
  throw Error(fmt::format("internal error: {} ({}:{}): {} -- this is a bug in microbatch", cond, file,
                          line, msg));
}

}  // namespace microbatch::detail
