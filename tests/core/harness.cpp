#include "tests/core/harness.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "core/rng.h"

namespace microbatch::testing {

namespace {
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
  Generator saved = default_generator();
  manual_seed(1234);
  Tensor r = rand(probe.shape(), {.dtype = DType::f64}) * 2.0 - 1.0;
  default_generator() = saved;

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
  Generator saved = default_generator();
  manual_seed(seed);
  Tensor u = rand(shape, {.dtype = DType::f64});
  default_generator() = saved;
  Tensor out = (u * (hi - lo) + lo).detach();
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

}  // namespace microbatch::testing
