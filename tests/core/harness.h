// The shared op harness: gradcheck in f64, reference comparisons, layout variants, and the
// CUDA skip that keeps GPU cases visible where no device is present.
#pragma once

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace microbatch::testing {

using OpFn = std::function<Tensor(const std::vector<Tensor>&)>;

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                       DType::i32, DType::i64, DType::u8,  DType::boolean};
inline constexpr DType kFloatDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

/// The JSON lines of dir/log.jsonl (a Trainer's log); a line still being written is left out.
std::vector<nlohmann::json> read_log(const std::filesystem::path& dir);
/// Its step lines: those that are not events.
std::vector<nlohmann::json> step_lines(const std::filesystem::path& dir);

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
};

/// Compares the analytic gradient of sum(f(inputs) * r) (r fixed random) with central differences,
/// for every floating input that requires grad. Inputs should be f64. Fails the current test
/// with the op name, input index and element on a mismatch.
void gradcheck(const std::string& name, const OpFn& f, const std::vector<Tensor>& inputs,
               GradcheckOptions options = {});

/// The same values as t (a leaf requiring grad if t does) in a non-contiguous layout.
Tensor non_contiguous(const Tensor& t);

/// A kernel view of no data with these shape and strides (for layout arithmetic).
kernels::StridedView view_of(const Shape& shape, const Shape& strides);

/// Deterministic f64 values in [lo, hi) with the given shape (requires grad).
Tensor input(const Shape& shape, double lo = -1.0, double hi = 1.0, std::uint64_t seed = 1);

/// Checks |actual - expected| <= atol + rtol * |expected| everywhere.
void check_close(const Tensor& actual, const std::vector<double>& expected, double rtol, double atol,
                 const std::string& what = "");
void check_close(const Tensor& actual, const Tensor& expected, double rtol, double atol,
                 const std::string& what = "");

/// A fresh folder under the system temporary folder, removed with its contents at scope exit.
struct TempDir {
  explicit TempDir(const std::string& prefix = "mb_test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  /// The names in the folder, sorted.
  std::vector<std::string> listing() const;
  std::filesystem::path path;
};

/// Runs `body` expecting microbatch::Error whose message contains `needle`.
void check_throws_with(const std::function<void()>& body, const std::string& needle);

bool has_cuda();

/// Note [Rehearsing the CUDA cases]: with MB_TEST_CUDA_REHEARSAL=1 on a machine without a CUDA
/// device, the CUDA cases (MB_CUDA_TEST_CASE) run with the CPU standing in for cuda:0: CPU
/// against CPU, so they check nothing of the CUDA backend, only that each case's own set-up,
/// shapes, indices and expectations hold, which a machine without a GPU cannot otherwise show.
/// The real run stays skipped and is counted so; the rehearsal is a ctest entry of its own
/// (core_cuda_rehearsal, train_cuda_rehearsal). Cases whose checks are about the device itself
/// (its allocator, streams, cuBLASLt's calls) are MB_CUDA_ONLY_TEST_CASE and skip there too.
bool cuda_rehearsal();

/// The device the CUDA cases put their device side on: cuda:0, or the CPU in a rehearsal.
Device test_gpu();

/// Tolerances of a CPU-vs-CUDA comparison (the f32 1e-3; REFERENCE.md's table for 16-bit).
struct ParityOptions {
  double rtol = 1e-3;
  double atol = 1e-3;
  bool check_grads = true;
};

/// Runs f on `inputs` (CPU tensors) and on copies of them on cuda:0 (leaves requiring grad where
/// the originals do), and checks the outputs agree and so do the gradients of sum(f(inputs) * r)
/// for a fixed random r. Fails the current test naming the op, the output or the input.
void check_cuda_parity(const std::string& name, const OpFn& f, const std::vector<Tensor>& inputs,
                       ParityOptions options = {});

/// Tolerances for a dtype: f32 1e-3; f16 and bf16 from REFERENCE.md; f64 1e-9.
ParityOptions parity_tolerance(DType dtype);

/// total + w * x as a gradient buffer of dtype `buffer` adds a weighted gradient in place: in f64
/// for f64 buffers, else the product and the sum in f32, rounded to the buffer's dtype.
double weighted_add_reference(double total, double x, double w, DType buffer);

/// Limits of run_in_child's child process.
struct ChildLimits {
  std::size_t headroom_bytes = 0;  // how far the address space may grow; 0 = no limit
  unsigned seconds = 10;           // killed by SIGALRM after this long
};

/// Runs `body` in a forked child under `limits` and returns what it returned, or how it failed:
/// "Error: <message>", "exception: <what>", "killed by signal <n> (<name>)". A loader that sizes a
/// buffer from a file's claim rather than from the data present dies of std::bad_alloc there; one
/// that blocks for ever is killed rather than stalling the suite.
std::string run_in_child(const std::function<std::string()>& body, ChildLimits limits);

}  // namespace microbatch::testing

/// A test case that needs a CUDA device; doctest counts it as skipped where there is none, and
/// runs it on the CPU in a rehearsal (Note [Rehearsing the CUDA cases]). All are in the test suite
/// "cuda" (doctest's --test-suite=cuda).
#define MB_CUDA_TEST_CASE(name)                                                  \
  TEST_CASE(name *                                                               \
            doctest::skip(!::microbatch::testing::has_cuda() &&                  \
                          !::microbatch::testing::cuda_rehearsal()) *            \
            doctest::test_suite("cuda"))

/// A CUDA case with nothing to rehearse on the CPU: skipped wherever there is no device.
#define MB_CUDA_ONLY_TEST_CASE(name) \
  TEST_CASE(name * doctest::skip(!::microbatch::testing::has_cuda()) * doctest::test_suite("cuda"))
