// The op profiler: per-op calls and self times on the host and on the device, as a table in the
// spirit of torch.profiler's key_averages().table(). `microbatch train --profile` (or MB_PROFILE=1)
// prints it after training, `bench_gpt2_cuda --profile` after its timed steps.
//
//   profiler::Session session;             // starts recording; stops at scope exit
//   ... forward, backward, optimizer step ...
//   std::cout << profiler::report().table();
//
// Note [Profiler scopes]:
// - A scope is a named piece of work: launch() opens one per kernel launch, under the op's name
//   ("linear"; the bias copy linear makes first is a "copy_" of its own), the autograd engine one
//   per backward node ("linear backward") and one per sum of two incoming gradients ("grad_sum").
// - Times are self times: a scope's time minus the time of the scopes opened inside it, so the rows
//   add up to the time spent in scopes and nothing is counted twice.
// - launch() opens a scope only where none is open: the kernels a backward node runs (matmul's
//   backward runs two matmuls) and an op launched inside another op's launch count toward the
//   enclosing scope. Backward nodes always open one, so a checkpoint's backward keeps its
//   recomputation as its self time and shows the nodes of its inner backward as their own rows.
// - Host time is the steady clock around the scope: launch overhead on CUDA, the kernels
//   themselves on the CPU. Device time is the time between two cudaEvents recorded on the device's
//   current stream around the scope: what the stream spent from the scope's first work to its
//   last, gaps while the host was still launching included. Completed events are read without
//   waiting once many are pending, and all of them when the report is made: profiling adds no host
//   synchronisation per op.
// - Meta tensors run no kernels and open no scopes, so the planner's passes are not counted. A
//   scope left by an exception counts up to the exception.
// - Off, launch() and the engine pay one relaxed load and one branch on a flag.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/device.h"

namespace microbatch::profiler {

namespace detail {
extern std::atomic<bool> g_enabled;
}  // namespace detail

/// Whether scopes are being recorded (one relaxed load).
inline bool enabled() { return detail::g_enabled.load(std::memory_order_relaxed); }

/// Forgets what was recorded, starts the span and turns recording on.
void start();
/// Turns recording off and ends the span, first waiting for the device work that recorded scopes
/// enqueued (so the span covers it). What was recorded stays for report().
void stop();
/// Forgets what was recorded and restarts the span; recording stays on or off. Scopes open across
/// a reset are dropped.
void reset();
/// True when the environment asks for profiling: MB_PROFILE set, non-empty and not "0".
bool requested_by_env();

/// Records for its lifetime: start() at construction, stop() at destruction.
class Session {
 public:
  Session() { start(); }
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

/// One name's totals. Times are self times in milliseconds (Note [Profiler scopes]).
struct ProfileRow {
  std::string name;               // "linear", "linear backward", "grad_sum"
  std::int64_t calls = 0;
  double host_ms = 0.0;
  std::int64_t device_calls = 0;  // the calls timed on a CUDA stream too
  double device_ms = 0.0;
};

struct ProfileReport {
  std::vector<ProfileRow> rows;  // by device time, then host time, the largest first
  double span_ms = 0.0;          // wall clock from start() (or reset()) to stop() or the report

  double host_total_ms() const;    // the sum of the rows' host times
  double device_total_ms() const;  // the sum of the rows' device times
  /// The table: per row calls, total and mean self time, and its share of the span, host and
  /// device; then the totals. max_rows > 0 folds the rows past it into one "other" row.
  std::string table(int max_rows = 0) const;
  /// {"span_ms", "host_total_ms", "device_total_ms", "rows": [{"name", "calls", "host_ms",
  /// "device_calls", "device_ms"}]}.
  nlohmann::json to_json() const;
};

/// What was recorded since start() or reset(), waiting for pending device events first.
ProfileReport report();

/// Whether a scope opens where another one is open already (Note [Profiler scopes]).
enum class Nesting { outermost_only, always };

/// Times its lifetime under `name` + `suffix` for work on `device`: launch() and the autograd
/// engine open these, and a program may too, to name a region of its own. Opens nothing while
/// the profiler is off, on meta, or (outermost_only) inside another scope.
class Scope {
 public:
  Scope(std::string_view name, Device device, Nesting nesting, std::string_view suffix = {});
  ~Scope();  // never throws
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Scope* parent_ = nullptr;
  int key_ = -1;     // the row; -1: not open
  int device_ = -1;  // the CUDA device whose stream is timed; -1: host time only
  void* start_event_ = nullptr;
  std::uint64_t generation_ = 0;  // of the recording it belongs to (reset() starts a new one)
  std::chrono::steady_clock::time_point host_start_;
};

}  // namespace microbatch::profiler
