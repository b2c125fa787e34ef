// The op profiler (core/profiler.h): which names it records and how often, that nested work is
// counted once, that off records nothing and reset forgets, and that the rows add up to the totals.
// No test asserts a duration: only counts, names and the arithmetic of the report.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/autograd.h"
#include "core/profiler.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// The row named `name`, or an empty one (0 calls) when there is none.
profiler::ProfileRow row(const profiler::ProfileReport& r, const std::string& name) {
  for (const profiler::ProfileRow& row : r.rows)
    if (row.name == name) return row;
  return profiler::ProfileRow{.name = name};
}

std::int64_t calls(const profiler::ProfileReport& r, const std::string& name) {
  return row(r, name).calls;
}

// Four leaves for three_matmuls, made before a test starts the profiler.
std::vector<Tensor> leaves(Device device = kCPU, DType dtype = DType::f64) {
  std::vector<Tensor> out;
  const Shape shapes[] = {{4, 5}, {5, 3}, {3, 6}, {6, 2}};
  std::uint64_t seed = 1;
  for (const Shape& shape : shapes) {
    Tensor t = input(shape, -1.0, 1.0, seed++).detach().to(device, dtype);
    out.push_back(t.requires_grad_(true));
  }
  return out;
}

// loss = sum(((a @ b) @ c) @ d): three matmuls forward, three matmul nodes backward, four leaves.
void three_matmuls(const std::vector<Tensor>& p) {
  Tensor loss = sum(matmul(matmul(matmul(p[0], p[1]), p[2]), p[3]));
  loss.backward();
}

void check_rows_add_up(const profiler::ProfileReport& r) {
  double host = 0.0, device = 0.0;
  for (const profiler::ProfileRow& x : r.rows) {
    host += x.host_ms;
    device += x.device_ms;
  }
  CHECK(r.host_total_ms() == doctest::Approx(host));
  CHECK(r.device_total_ms() == doctest::Approx(device));
}

}  // namespace

TEST_CASE("profiler: forward ops and backward nodes by name, each counted once") {
  const std::vector<Tensor> p = leaves();
  profiler::Session session;
  CHECK(profiler::enabled());
  three_matmuls(p);
  const profiler::ProfileReport r = profiler::report();
  CHECK(calls(r, "matmul") == 3);
  // matmul's backward runs two matmuls of its own: they are part of "matmul backward", not rows.
  CHECK(calls(r, "matmul backward") == 3);
  CHECK(calls(r, "sum") == 1);
  CHECK(calls(r, "sum backward") == 1);
  CHECK(calls(r, "AccumulateGrad") == 4);
  CHECK(calls(r, "fill_") >= 1);  // the seed gradient of backward
  for (const profiler::ProfileRow& x : r.rows) {
    CHECK(x.device_calls == 0);  // CPU work has host time only
    CHECK(x.device_ms == 0.0);
  }
  check_rows_add_up(r);
  CHECK(r.host_total_ms() <= r.span_ms);
}

TEST_CASE("profiler: off records nothing; reset forgets; start begins afresh") {
  const std::vector<Tensor> p = leaves();
  {
    profiler::Session session;
    three_matmuls(p);
  }
  CHECK_FALSE(profiler::enabled());
  CHECK(calls(profiler::report(), "matmul") == 3);  // kept after stop for the report
  three_matmuls(p);                                  // off: not recorded
  CHECK(calls(profiler::report(), "matmul") == 3);
  profiler::reset();
  CHECK(profiler::report().rows.empty());
  three_matmuls(p);
  CHECK(profiler::report().rows.empty());

  profiler::Session session;
  three_matmuls(p);
  profiler::reset();
  CHECK(profiler::report().rows.empty());
  Tensor x = ones({3});
  (void)(x + x);
  const profiler::ProfileReport r = profiler::report();
  CHECK(calls(r, "add") == 1);
  CHECK(calls(r, "matmul") == 0);
  profiler::start();  // a second start clears too
  CHECK(profiler::report().rows.empty());
}

TEST_CASE("profiler: copies, which do not go through launch(), are rows too") {
  Tensor x = ones({4, 6});
  profiler::Session session;
  Tensor y = x.t().contiguous();  // (6, 4)
  Tensor z = x.clone();
  const profiler::ProfileReport r = profiler::report();
  CHECK(calls(r, "copy_") == 2);
}

TEST_CASE("profiler: meta tensors open no scopes") {
  profiler::Session session;
  Tensor a = ones({8, 8}, {.device = kMeta});
  (void)matmul(a, a);
  (void)(a + a);
  CHECK(profiler::report().rows.empty());
}

TEST_CASE("profiler: a region owns the ops inside it; nested regions report self time") {
  profiler::Session session;
  Tensor x = ones({16});
  {
    profiler::Scope outer("outer", kCPU, profiler::Nesting::always);
    (void)(x + x);
    {
      profiler::Scope inner("inner", kCPU, profiler::Nesting::always);
      (void)(x * x);
    }
    // An outermost_only scope inside another one does not open.
    profiler::Scope quiet("quiet", kCPU, profiler::Nesting::outermost_only);
  }
  (void)(x - x);
  const profiler::ProfileReport r = profiler::report();
  CHECK(calls(r, "outer") == 1);
  CHECK(calls(r, "inner") == 1);
  CHECK(calls(r, "quiet") == 0);
  CHECK(calls(r, "add") == 0);  // launched inside "outer"
  CHECK(calls(r, "mul") == 0);  // launched inside "inner"
  CHECK(calls(r, "sub") == 1);  // at the top level again
  CHECK(row(r, "outer").host_ms >= 0.0);  // its time less inner's
  check_rows_add_up(r);
}

TEST_CASE("profiler: a scope left by an exception counts, and the next op is a row of its own") {
  profiler::Session session;
  try {
    profiler::Scope scope("failing", kCPU, profiler::Nesting::always);
    throw std::runtime_error("expected");
  } catch (const std::runtime_error&) {
  }
  Tensor x = ones({4});
  (void)(x + x);
  const profiler::ProfileReport r = profiler::report();
  CHECK(calls(r, "failing") == 1);
  CHECK(calls(r, "add") == 1);
}

TEST_CASE("profiler: a scope still open at stop() counts only up to the span's end") {
  profiler::start();
  {
    profiler::Scope outer("outer", kCPU, profiler::Nesting::always);
    profiler::Scope open("open", kCPU, profiler::Nesting::always);
    profiler::stop();
    // Time after the span's end, which no row may count (it made a row 400% of the span).
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const profiler::ProfileReport r = profiler::report();
  CHECK(calls(r, "open") == 1);
  CHECK(calls(r, "outer") == 1);
  CHECK(row(r, "open").host_ms <= r.span_ms);
  CHECK(r.host_total_ms() <= r.span_ms);
  check_rows_add_up(r);
  profiler::reset();
}

TEST_CASE("profiler: a checkpoint's backward holds its recomputation; its inner nodes are rows") {
  Tensor x = input({5}, -1.0, 1.0, 7);
  Tensor w = input({5}, -1.0, 1.0, 8);
  profiler::Session session;
  Tensor y = checkpoint([&](const Tensor& t) { return tanh(t * w); }, x);
  sum(y).backward();
  const profiler::ProfileReport r = profiler::report();
  CHECK(calls(r, "checkpoint backward") == 1);
  CHECK(calls(r, "mul") == 1);  // the forward only: the recomputation is inside the checkpoint's
  CHECK(calls(r, "tanh") == 1);
  CHECK(calls(r, "mul backward") == 1);
  CHECK(calls(r, "tanh backward") == 1);
  check_rows_add_up(r);
}

TEST_CASE("profiler: the table and the JSON list every row and the totals") {
  const std::vector<Tensor> leaves_f32 = leaves(kCPU, DType::f32);
  profiler::Session session;
  three_matmuls(leaves_f32);
  Tensor p = input({3}, -1.0, 1.0, 9);
  Tensor q = p * 2.0;
  sum(q + q).backward();  // q's two gradients meet in the engine: one grad_sum
  const profiler::ProfileReport r = profiler::report();
  CHECK(calls(r, "grad_sum") == 1);
  check_rows_add_up(r);
  CHECK(r.host_total_ms() <= r.span_ms);

  const std::string table = r.table();
  for (const profiler::ProfileRow& x : r.rows) CHECK(table.find(x.name) != std::string::npos);
  CHECK(table.find("total") != std::string::npos);
  CHECK(table.find("device ms") == std::string::npos);  // no device columns for CPU work

  // Folding rows into "other" keeps the total.
  const std::string short_table = r.table(2);
  CHECK(short_table.find("other (") != std::string::npos);

  const nlohmann::json j = r.to_json();
  CHECK(j["rows"].size() == r.rows.size());
  CHECK(j["host_total_ms"].get<double>() == doctest::Approx(r.host_total_ms()));
}

TEST_CASE("profiler: MB_PROFILE asks for profiling unless empty or 0") {
  const char* saved = std::getenv("MB_PROFILE");
  const std::string restore = saved ? saved : "";
  setenv("MB_PROFILE", "1", 1);
  CHECK(profiler::requested_by_env());
  setenv("MB_PROFILE", "0", 1);
  CHECK_FALSE(profiler::requested_by_env());
  setenv("MB_PROFILE", "", 1);
  CHECK_FALSE(profiler::requested_by_env());
  if (saved) {
    setenv("MB_PROFILE", restore.c_str(), 1);
  } else {
    unsetenv("MB_PROFILE");
  }
}

MB_CUDA_ONLY_TEST_CASE("profiler: CUDA scopes are timed with events on the stream") {
  const Device cuda = cuda_device(0);
  for (DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const std::vector<Tensor> p = leaves(cuda, dtype);
    profiler::Session session;
    three_matmuls(p);
    // More scopes than the profiler lets pend before it reads completed events without waiting,
    // queued behind about 20 ms of GEMMs so that the device lags: the profiler then meets events
    // that are not ready yet, and the launches after that must not take "not ready" for an error.
    Tensor big = ones({4096, 4096}, {.dtype = DType::f32, .device = cuda});
    for (int i = 0; i < 8; ++i) big = matmul(big, big) * (1.0 / 4096);
    Tensor x = ones({1000003}, {.dtype = dtype, .device = cuda});
    Tensor y = x;
    for (int i = 0; i < 1500; ++i) y = y + x;
    // Read in f64 from the device: item() on an f32 CPU tensor would cast, a CPU scope.
    CHECK(big.to(kCPU, DType::f64).slice(0, 0, 1).slice(1, 0, 1).item() == 1.0);
    const profiler::ProfileReport r = profiler::report();
    CHECK(calls(r, "matmul") == 3 + 8);
    CHECK(row(r, "matmul").device_calls == 3 + 8);
    CHECK(calls(r, "matmul backward") == 3);
    CHECK(row(r, "matmul backward").device_calls == 3);
    CHECK(calls(r, "add") == 1500);
    CHECK(row(r, "add").device_calls == 1500);
    for (const profiler::ProfileRow& x : r.rows) {
      CHECK(x.device_calls == x.calls);  // every scope here ran on cuda:0
      CHECK(std::isfinite(x.device_ms));
    }
    check_rows_add_up(r);
    CHECK(r.table().find("device ms") != std::string::npos);
  }
}
