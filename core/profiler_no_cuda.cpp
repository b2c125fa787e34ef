// The profiler's device clock in builds without the CUDA backend: no CUDA tensor exists there, so
// no scope times a stream and these are never reached.
#include "core/error.h"
#include "core/profiler_events.h"

namespace microbatch::profiler::events {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  ::microbatch::detail::throw_error(fmt::format("[{}] this build has no CUDA backend", what));
}
}  // namespace

Event create(int) { no_cuda("profiler::events::create"); }
void record(Event, int) { no_cuda("profiler::events::record"); }
bool done(Event) { no_cuda("profiler::events::done"); }
void wait(Event) { no_cuda("profiler::events::wait"); }
double elapsed_ms(Event, Event) { no_cuda("profiler::events::elapsed_ms"); }

}  // namespace microbatch::profiler::events
