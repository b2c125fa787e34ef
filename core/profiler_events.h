// The profiler's device clock: CUDA events recorded on a device's current stream. Defined by
// core/profiler_cuda.cpp in CUDA builds and by core/profiler_no_cuda.cpp (stubs that throw; no
// CUDA scope can open there) otherwise. Used by core/profiler.cpp only.
#pragma once

namespace microbatch::profiler::events {

using Event = void*;  // a cudaEvent_t

/// A new timing event on `device`.
Event create(int device);
/// Records e on the current stream of `device` (which it makes current, as launch() would).
void record(Event e, int device);
/// Whether the work before e has finished, without waiting.
bool done(Event e);
/// Waits for the work before e.
void wait(Event e);
/// Milliseconds between two completed events of one stream.
double elapsed_ms(Event start, Event end);

}  // namespace microbatch::profiler::events
