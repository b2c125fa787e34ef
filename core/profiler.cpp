// The op profiler (Note [Profiler scopes] in core/profiler.h).
//
// - Each name has one row of totals. A scope adds its time to its row and takes it off its
//   parent's row (the scope open on the same thread when it opened), which makes the times self
//   times; for device time, only a parent timed on the same device.
// - Host times are added when a scope closes. A CUDA scope's two events wait in a queue, in the
//   order scopes closed, until they are read: without waiting, for the completed front of the
//   queue, every kFoldEvery closed scopes; waiting, by report() and stop(). Read events return to a pool
//   (one per device) and are recorded again by later scopes, so a long run creates few of them.
// - The state lives for the whole process (like the CUDA handles) and is guarded by one mutex;
//   the stack of open scopes is per thread.
#include "core/profiler.h"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/profiler_events.h"

namespace microbatch::profiler {

namespace detail {
std::atomic<bool> g_enabled{false};
}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;

// Closed CUDA scopes between two reads of the completed ones: rare enough to cost nothing, often
// enough that a long profiled run keeps a few thousand events at most.
constexpr std::size_t kFoldEvery = 512;

// A closed CUDA scope whose device time is not read yet.
struct Pending {
  int key = -1;
  int parent_key = -1;  // the row its time is taken off; -1: none
  int device = 0;
  events::Event start = nullptr, end = nullptr;
};

struct State {
  std::mutex mutex;
  std::uint64_t generation = 1;
  std::vector<ProfileRow> rows;
  std::unordered_map<std::string, int> keys;  // name -> index into rows
  std::deque<Pending> pending;
  std::vector<std::vector<events::Event>> free_events;  // by device index
  std::size_t closed_since_fold = 0;
  Clock::time_point span_start = Clock::now();
  Clock::time_point span_end = span_start;
  bool running = false;
};

State& state() {
  static State* s = new State;  // never destroyed: scopes may close during static destruction
  return *s;
}

thread_local Scope* t_current = nullptr;  // the innermost open scope of this thread

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

int key_of(State& s, std::string_view name, std::string_view suffix) {
  std::string label(name);
  label += suffix;
  auto [it, inserted] = s.keys.try_emplace(std::move(label), static_cast<int>(s.rows.size()));
  if (inserted) s.rows.push_back(ProfileRow{.name = it->first});
  return it->second;
}

events::Event take_event(State& s, int device) {
  if (static_cast<std::size_t>(device) >= s.free_events.size()) s.free_events.resize(device + 1);
  auto& pool = s.free_events[device];
  if (pool.empty()) return events::create(device);
  events::Event e = pool.back();
  pool.pop_back();
  return e;
}

void give_back(State& s, int device, events::Event e) {
  if (e != nullptr) s.free_events[device].push_back(e);
}

enum class Wait { no, yes };

// Adds the device times of the pending scopes whose events have completed (all of them, waiting,
// with Wait::yes), front first.
void fold(State& s, Wait wait) {
  while (!s.pending.empty()) {
    const Pending& p = s.pending.front();
    // Both events: a scope the current stream changed in has them on two streams, and then the
    // end's completion says nothing of the start's.
    if (wait == Wait::yes) {
      events::wait(p.start);
      events::wait(p.end);
    } else if (!events::done(p.end) || !events::done(p.start)) {
      return;
    }
    const double ms = events::elapsed_ms(p.start, p.end);
    s.rows[p.key].device_ms += ms;
    if (p.parent_key >= 0) s.rows[p.parent_key].device_ms -= ms;
    give_back(s, p.device, p.start);
    give_back(s, p.device, p.end);
    s.pending.pop_front();
  }
}

void clear(State& s) {
  ++s.generation;
  s.rows.clear();
  s.keys.clear();
  for (const Pending& p : s.pending) {
    give_back(s, p.device, p.start);
    give_back(s, p.device, p.end);
  }
  s.pending.clear();
  s.closed_since_fold = 0;
  s.span_start = Clock::now();
  s.span_end = s.span_start;
}

double percent(double part, double whole) { return whole > 0.0 ? 100.0 * part / whole : 0.0; }

}  // namespace

// ---- recording ---------------------------------------------------------------------------------

void start() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  clear(s);
  s.running = true;
  detail::g_enabled.store(true, std::memory_order_relaxed);
}

void stop() {
  detail::g_enabled.store(false, std::memory_order_relaxed);
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.running) return;
  s.running = false;
  fold(s, Wait::yes);
  s.span_end = Clock::now();
}

void reset() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  clear(s);
}

bool requested_by_env() {
  const char* value = std::getenv("MB_PROFILE");
  return value != nullptr && value[0] != '\0' && std::string_view(value) != "0";
}

Session::~Session() {
  try {
    stop();
  } catch (...) {
    // A destructor does not throw; a sticky device error shows again at the next CUDA call.
    detail::g_enabled.store(false, std::memory_order_relaxed);
  }
}

Scope::Scope(std::string_view name, Device device, Nesting nesting, std::string_view suffix) {
  if (!enabled() || device.is_meta()) return;
  if (nesting == Nesting::outermost_only && t_current != nullptr) return;
  State& s = state();
  {
    std::lock_guard lock(s.mutex);
    if (device.is_cuda()) start_event_ = take_event(s, device.index);
    key_ = key_of(s, name, suffix);
    generation_ = s.generation;
  }
  if (device.is_cuda()) {
    try {
      events::record(start_event_, device.index);
    } catch (...) {
      std::lock_guard lock(s.mutex);
      give_back(s, device.index, start_event_);
      key_ = -1;
      throw;
    }
    device_ = device.index;
  }
  parent_ = t_current;
  t_current = this;
  host_start_ = Clock::now();
}

Scope::~Scope() {
  if (key_ < 0) return;
  const Clock::time_point host_end = Clock::now();
  t_current = parent_;
  State& s = state();
  events::Event end_event = nullptr;
  if (device_ >= 0) {
    try {
      {
        std::lock_guard lock(s.mutex);
        end_event = take_event(s, device_);
      }
      events::record(end_event, device_);
    } catch (...) {
      // Recording failed: keep the host time and drop the device time, since a destructor cannot
      // report the error (a sticky device error shows again at the next CUDA call).
      std::lock_guard lock(s.mutex);
      give_back(s, device_, start_event_);
      give_back(s, device_, end_event);
      start_event_ = end_event = nullptr;
    }
  }
  std::lock_guard lock(s.mutex);
  if (generation_ != s.generation) {  // reset() since it opened
    if (start_event_ != nullptr) give_back(s, device_, start_event_);
    if (end_event != nullptr) give_back(s, device_, end_event);
    return;
  }
  // A scope still open at stop() counts up to the span's end, as its parents do; its device time,
  // which stop() no longer waits for, is dropped.
  const double host_ms =
      std::max(0.0, ms_between(host_start_, s.running ? host_end : std::min(host_end, s.span_end)));
  if (!s.running && end_event != nullptr) {
    give_back(s, device_, start_event_);
    give_back(s, device_, end_event);
    end_event = nullptr;
  }
  ProfileRow& row = s.rows[key_];
  ++row.calls;
  row.host_ms += host_ms;
  const bool parent_counts = parent_ != nullptr && parent_->generation_ == s.generation;
  if (parent_counts) s.rows[parent_->key_].host_ms -= host_ms;
  if (end_event == nullptr) return;
  ++row.device_calls;
  const bool parent_on_device = parent_counts && parent_->device_ == device_;
  s.pending.push_back({.key = key_,
                       .parent_key = parent_on_device ? parent_->key_ : -1,
                       .device = device_,
                       .start = start_event_,
                       .end = end_event});
  if (++s.closed_since_fold >= kFoldEvery) {
    s.closed_since_fold = 0;
    try {
      fold(s, Wait::no);
    } catch (...) {
      // Left pending: report() reads them again and raises the error there.
    }
  }
}

// ---- the report --------------------------------------------------------------------------------

ProfileReport report() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  fold(s, Wait::yes);
  ProfileReport r;
  r.span_ms = ms_between(s.span_start, s.running ? Clock::now() : s.span_end);
  for (const ProfileRow& row : s.rows)
    if (row.calls > 0) r.rows.push_back(row);
  std::sort(r.rows.begin(), r.rows.end(), [](const ProfileRow& a, const ProfileRow& b) {
    if (a.device_ms != b.device_ms) return a.device_ms > b.device_ms;
    if (a.host_ms != b.host_ms) return a.host_ms > b.host_ms;
    return a.name < b.name;
  });
  return r;
}

double ProfileReport::host_total_ms() const {
  double total = 0.0;
  for (const ProfileRow& row : rows) total += row.host_ms;
  return total;
}

double ProfileReport::device_total_ms() const {
  double total = 0.0;
  for (const ProfileRow& row : rows) total += row.device_ms;
  return total;
}

std::string ProfileReport::table(int max_rows) const {
  std::vector<ProfileRow> shown = rows;
  if (max_rows > 0 && shown.size() > static_cast<std::size_t>(max_rows)) {
    ProfileRow other{.name = fmt::format("other ({} names)", shown.size() - max_rows)};
    for (std::size_t i = max_rows; i < shown.size(); ++i) {
      other.calls += shown[i].calls;
      other.host_ms += shown[i].host_ms;
      other.device_calls += shown[i].device_calls;
      other.device_ms += shown[i].device_ms;
    }
    shown.resize(max_rows);
    shown.push_back(other);
  }
  ProfileRow total{.name = "total"};
  for (const ProfileRow& row : shown) {
    total.calls += row.calls;
    total.host_ms += row.host_ms;
    total.device_calls += row.device_calls;
    total.device_ms += row.device_ms;
  }
  const bool device = total.device_calls > 0;
  std::size_t width = 24;
  for (const ProfileRow& row : shown) width = std::max(width, row.name.size());

  // Self times in ms, their share of the span, and per call in microseconds.
  auto line = [&](const std::string& name, const std::string& calls, const std::string& host,
                  const std::string& host_pct, const std::string& host_mean, const std::string& dev,
                  const std::string& dev_pct, const std::string& dev_mean) {
    std::string out = fmt::format("{:<{}}  {:>8}  {:>11}  {:>7}  {:>12}", name, width, calls, host,
                                  host_pct, host_mean);
    if (device) out += fmt::format("  {:>11}  {:>7}  {:>12}", dev, dev_pct, dev_mean);
    return out + "\n";
  };
  auto cells = [&](const ProfileRow& row) {
    const double host_mean = row.calls > 0 ? 1e3 * row.host_ms / row.calls : 0.0;
    const double dev_mean = row.device_calls > 0 ? 1e3 * row.device_ms / row.device_calls : 0.0;
    const bool timed = row.device_calls > 0;
    return line(row.name, std::to_string(row.calls), fmt::format("{:.3f}", row.host_ms),
                fmt::format("{:.1f}%", percent(row.host_ms, span_ms)),
                fmt::format("{:.1f}", host_mean),
                timed ? fmt::format("{:.3f}", row.device_ms) : "-",
                timed ? fmt::format("{:.1f}%", percent(row.device_ms, span_ms)) : "-",
                timed ? fmt::format("{:.1f}", dev_mean) : "-");
  };
  std::string out = line("name", "calls", "host ms", "host %", "host us/call", "device ms",
                         "device %", "device us/call");
  const std::string rule(out.size() - 1, '-');
  out += rule + "\n";
  for (const ProfileRow& row : shown) out += cells(row);
  out += rule + "\n";
  out += cells(total);
  out += fmt::format(
      "self times (a scope's time less the scopes inside it); % of the profiled span, {:.3f} ms "
      "of wall clock\n",
      span_ms);
  return out;
}

nlohmann::json ProfileReport::to_json() const {
  nlohmann::json out_rows = nlohmann::json::array();
  for (const ProfileRow& row : rows) {
    out_rows.push_back({{"name", row.name},
                        {"calls", row.calls},
                        {"host_ms", row.host_ms},
                        {"device_calls", row.device_calls},
                        {"device_ms", row.device_ms}});
  }
  return {{"span_ms", span_ms},
          {"host_total_ms", host_total_ms()},
          {"device_total_ms", device_total_ms()},
          {"rows", out_rows}};
}

}  // namespace microbatch::profiler
