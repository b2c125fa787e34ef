#include "tests/core/harness.h"

#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/rng.h"

namespace microbatch::testing {

namespace {
// f64 values uniform in [lo, hi) drawn from `seed`, leaving the default generator as it was.
Tensor seeded_uniform(const Shape& shape, std::uint64_t seed, double lo, double hi) {
  GeneratorStateGuard restore;
  manual_seed(seed);
  return rand(shape, {.dtype = DType::f64}) * (hi - lo) + lo;
}

// Pointer to the flat-th element (row-major logical order) of a CPU f64 tensor.
double* element(const Tensor& t, std::int64_t flat) {
  std::int64_t off = 0;
  for (int d = t.dim() - 1; d >= 0; --d) {
    const std::int64_t n = t.shape()[d];
    off += (flat % n) * t.strides()[d];
    flat /= n;
  }
  return static_cast<double*>(t.storage()->data) + t.offset() + off;
}
}  // namespace

void gradcheck(const std::string& name, const OpFn& f, const std::vector<Tensor>& inputs,
               GradcheckOptions options) {
  Tensor probe;
  {
    NoGradGuard no_grad;
    probe = f(inputs);
  }
  // A fixed random projection makes every output element matter.
  Tensor r = seeded_uniform(probe.shape(), 1234, -1.0, 1.0);

  for (const Tensor& t : inputs) if (t.defined() && t.requires_grad()) t.set_grad({});
  Tensor loss = sum(f(inputs) * r);
  loss.backward();

  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.defined() || !x.requires_grad()) continue;
    REQUIRE_MESSAGE(x.dtype() == DType::f64, name << ": gradcheck needs f64 input " << i);
    Tensor analytic = x.grad();
    REQUIRE_MESSAGE(analytic.defined(), name << ": input " << i << " got no gradient");
    const std::vector<double> a = analytic.to_vector();
    for (std::int64_t j = 0; j < x.numel(); ++j) {
      double* p = element(x, j);
      const double orig = *p;
      double plus, minus;
      {
        NoGradGuard no_grad;
        *p = orig + options.eps;
        plus = sum(f(inputs) * r).item();
        *p = orig - options.eps;
        minus = sum(f(inputs) * r).item();
        *p = orig;
      }
      const double numeric = (plus - minus) / (2 * options.eps);
      const bool ok = std::abs(a[j] - numeric) <= options.atol + options.rtol * std::abs(numeric);
      CHECK_MESSAGE(ok, name << ": input " << i << " element " << j << ": analytic " << a[j]
                             << " vs numeric " << numeric);
      if (!ok) return;
    }
  }
}

kernels::StridedView view_of(const Shape& shape, const Shape& strides) {
  kernels::StridedView v;
  v.ndim = static_cast<int>(shape.size());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = shape[i];
    v.strides[i] = strides[i];
  }
  return v;
}

Tensor non_contiguous(const Tensor& t) {
  Shape wide = t.shape();
  wide.push_back(2);
  Tensor base = zeros(wide, {.dtype = t.dtype(), .device = t.device()});
  Tensor view = base.select(-1, 0);
  {
    NoGradGuard no_grad;
    view.copy_(t);
  }
  Tensor out = view.detach();
  if (t.requires_grad()) out.requires_grad_(true);
  return out;
}

Tensor input(const Shape& shape, double lo, double hi, std::uint64_t seed) {
  Tensor out = seeded_uniform(shape, seed, lo, hi).detach();
  out.requires_grad_(true);
  return out;
}

void check_close(const Tensor& actual, const std::vector<double>& expected, double rtol, double atol,
                 const std::string& what) {
  const std::vector<double> a = actual.to_vector();
  REQUIRE_MESSAGE(a.size() == expected.size(), what << ": " << a.size() << " values, expected "
                                                    << expected.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double e = expected[i];
    const bool both_nan = std::isnan(a[i]) && std::isnan(e);
    const bool same_inf = std::isinf(a[i]) && a[i] == e;
    const bool ok = both_nan || same_inf || std::abs(a[i] - e) <= atol + rtol * std::abs(e);
    CHECK_MESSAGE(ok, what << ": element " << i << " is " << a[i] << ", expected " << e);
    if (!ok) return;
  }
}

void check_close(const Tensor& actual, const Tensor& expected, double rtol, double atol,
                 const std::string& what) {
  REQUIRE_MESSAGE(actual.shape() == expected.shape(),
                  what << ": shape " << shape_str(actual.shape()) << " vs " << shape_str(expected.shape()));
  check_close(actual, expected.to_vector(), rtol, atol, what);
}

void check_throws_with(const std::function<void()>& body, const std::string& needle) {
  try {
    body();
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find(needle) != std::string::npos,
                  "error message '" << msg << "' does not contain '" << needle << "'");
    return;
  }
  FAIL_CHECK("expected microbatch::Error containing '" << needle << "', nothing was thrown");
}

bool has_cuda() { return cuda_available(); }

bool cuda_rehearsal() {
  static const bool on = [] {
    const char* env = std::getenv("MB_TEST_CUDA_REHEARSAL");
    const bool rehearse = env != nullptr && std::string(env) == "1" && !has_cuda();
    if (rehearse) {
      std::fprintf(stderr,
                   "[rehearsal] CUDA cases run with the CPU standing in for cuda:0: they check the "
                   "cases' own logic, not the CUDA backend (Note [Rehearsing the CUDA cases])\n");
    }
    return rehearse;
  }();
  return on;
}

Device test_gpu() { return cuda_rehearsal() ? kCPU : cuda_device(0); }

ParityOptions parity_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f64: return {.rtol = 1e-9, .atol = 1e-9};
    case DType::f16: return {.rtol = 1e-2, .atol = 1e-2};
    case DType::bf16: return {.rtol = 4e-2, .atol = 4e-2};
    default: return {.rtol = 1e-3, .atol = 1e-3};
  }
}

void check_cuda_parity(const std::string& name, const OpFn& f, const std::vector<Tensor>& inputs,
                       ParityOptions options) {
  REQUIRE_MESSAGE((has_cuda() || cuda_rehearsal()), name << ": check_cuda_parity needs a CUDA device");
  const Device gpu = test_gpu();
  std::vector<Tensor> on_gpu;
  for (const Tensor& t : inputs) {
    if (!t.defined()) {
      on_gpu.emplace_back();
      continue;
    }
    Tensor g;
    {
      NoGradGuard no_grad;
      g = t.to(gpu);
    }
    if (t.requires_grad()) g.requires_grad_(true);
    on_gpu.push_back(g);
  }
  for (const Tensor& t : inputs) if (t.defined() && t.requires_grad()) t.set_grad({});
  Tensor out_cpu = f(inputs);
  Tensor out_gpu = f(on_gpu);
  REQUIRE_MESSAGE(out_gpu.device() == gpu, name << ": the CUDA result is on " << out_gpu.device().str());
  REQUIRE_MESSAGE(out_gpu.dtype() == out_cpu.dtype(),
                  name << ": dtype " << dtype_name(out_gpu.dtype()) << " on CUDA vs "
                       << dtype_name(out_cpu.dtype()) << " on CPU");
  Tensor cpu_values, gpu_values;
  {
    NoGradGuard no_grad;
    cpu_values = out_cpu.to(DType::f64);
    gpu_values = out_gpu.to(kCPU).to(DType::f64);
  }
  check_close(gpu_values, cpu_values, options.rtol, options.atol, name + " output");
  if (!options.check_grads || !out_cpu.requires_grad()) return;

  Tensor r = seeded_uniform(out_cpu.shape(), 4321, -1.0, 1.0);
  sum(out_cpu.to(DType::f64) * r).backward();
  sum(out_gpu.to(DType::f64) * r.to(gpu)).backward();
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    Tensor gc = inputs[i].grad(), gg = on_gpu[i].grad();
    REQUIRE_MESSAGE(gc.defined() == gg.defined(), name << ": input " << i << " has a gradient on one device only");
    if (!gc.defined()) continue;
    NoGradGuard no_grad;
    check_close(gg.to(kCPU).to(DType::f64), gc.to(DType::f64), options.rtol, options.atol,
                name + " gradient of input " + std::to_string(i));
  }
}

TempDir::TempDir(const std::string& prefix) {
  static std::atomic<int> counter{0};
  path = std::filesystem::temp_directory_path() / fmt::format("{}_{}_{}", prefix, ::getpid(), counter++);
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::vector<std::string> TempDir::listing() const {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

double weighted_add_reference(double total, double x, double w, DType buffer) {
  if (buffer == DType::f64) {
    const double product = w * x;
    return total + product;
  }
  const float product = static_cast<float>(w) * static_cast<float>(x);
  const float sum = static_cast<float>(total) + product;
  return from_vector({static_cast<double>(sum)}, {1}).to(buffer).to_vector()[0];
}

std::string run_in_child(const std::function<std::string()>& body, ChildLimits limits) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    ::alarm(limits.seconds);
    std::string report;
    try {
      if (limits.headroom_bytes > 0) {
        // Large blocks must be fresh mappings, which the limit counts, not heap the parent freed.
        ::mallopt(M_MMAP_THRESHOLD, 128 << 10);
        std::size_t pages = 0;
        std::ifstream("/proc/self/statm") >> pages;
        rlimit limit{};
        ::getrlimit(RLIMIT_AS, &limit);
        const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
        limit.rlim_cur = std::min<rlim_t>(pages * page + limits.headroom_bytes, limit.rlim_max);
        ::setrlimit(RLIMIT_AS, &limit);
      }
      report = body();
    } catch (const Error& e) {
      report = std::string("Error: ") + e.what();
    } catch (const std::exception& e) {
      report = std::string("exception: ") + e.what();
    }
    for (std::size_t done = 0; done < report.size();) {
      const ::ssize_t n = ::write(fds[1], report.data() + done, report.size() - done);
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    ::_exit(0);  // no destructors, no doctest reporting: those belong to the parent
  }
  ::close(fds[1]);
  std::string report;
  char buf[4096];
  for (;;) {
    const ::ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    report.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + ::strsignal(sig) + ")";
  }
  return report;
}

std::vector<nlohmann::json> read_log(const std::filesystem::path& dir) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(dir / "log.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    // A run being watched may be in the middle of a line.
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) lines.push_back(std::move(j));
  }
  return lines;
}

std::vector<nlohmann::json> step_lines(const std::filesystem::path& dir) {
  std::vector<nlohmann::json> lines;
  for (auto& l : read_log(dir))
    if (!l.contains("event")) lines.push_back(l);
  return lines;
}

}  // namespace microbatch::testing
