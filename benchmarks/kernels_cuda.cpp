// bench_kernels_cuda: the memory-bound kernels of a training step against the device's copy
// bandwidth, called through the public APIs a training step uses (accumulate_, ParamStore and
// optim::AdamW, cross_entropy and its backward) or, for the gradient norm, the kernel entry point
// the boundary step calls (kernels::cuda::sum_squares). Each kernel is first checked against the CPU
// kernels on slices of its real operands (start, middle, end; for AdamW also the decay boundary);
// a mismatch is printed and makes the program fail. Then it is timed: the median of --reps
// repetitions after --warmup, each between two cudaEvents on the current stream.
//
//   bench_kernels_cuda [--json PATH] [--reps 20] [--warmup 3] [--quick] [--device cuda|cpu]
//
// --quick shrinks every size (a fast smoke run); --device cpu runs the same program on the CPU
// with --quick sizes, to exercise its logic on a machine without a GPU (its figures mean nothing).
//
// Note [Bytes moved]: a figure counts the bytes a kernel must move at the least — every operand
// element read once, every output element written once — not what it happens to move.
// GB/s = bytes / median time / 1e9; the ratio divides that by the copy's GB/s.
//   copy                        2 n for an n-byte cudaMemcpyAsync (read n, write n)
//   accumulate f32 += w * f32   12 B/element (read dst 4 and src 4, write dst 4)
//   accumulate f32 += w * bf16  10 B/element (read dst 4 and src 2, write dst 4)
//   gradient norm + non-finite   4 B/element (read each f32 gradient once; 2 GiB of them)
//   AdamW, bf16 working copy    30 B/element (read the f32 gradient 4; read and write the f32
//                               master 8, exp_avg 8, exp_avg_sq 8; write the bf16 weight 2)
//   cross-entropy forward        2 B/logit + 20 B/row (read bf16 logits; read the i64 target,
//                               write the f32 row loss and the (max, log-sum) f32 stats)
//   cross-entropy backward       4 B/logit + 20 B/row (read logits, write dlogits; read the
//                               target, the stats and the row's incoming gradient)
// Small reductions around them (the mean over rows, the seed gradient) are timed but not counted.
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/bench_util.h"
#include "core/autograd.h"
#include "core/ops.h"
#include "kernels/optim.h"
#include "nn/module.h"
#include "optim/optimizer.h"
#include "optim/param_store.h"

namespace mb = microbatch;
using mb::DType;
using mb::Tensor;
using mb::bench::check_close;
using mb::bench::Timing;

namespace {

// GPT-2 small's parameter arena: every matrix (wte, wpe, and four per block) gets weight decay,
// 124,318,464 elements; every bias and LayerNorm parameter does not, 121,344; 124,439,808 in all.
constexpr std::int64_t kGpt2Decay = 124'318'464;
constexpr std::int64_t kGpt2NoDecay = 121'344;

struct Sizes {
  std::int64_t copy_bytes;
  std::int64_t accumulate_n;  // elements of dst (and of src)
  std::int64_t norm_n;        // f32 elements reduced
  std::int64_t arena_decay, arena_no_decay;
  std::int64_t ce_rows, ce_cols;
};

constexpr Sizes kFull{.copy_bytes = 2LL << 30,     // 2 GiB copied: 4 GiB moved
                      .accumulate_n = 256LL << 20,  // f32 dst 1 GiB + src 1 GiB
                      .norm_n = 512LL << 20,        // 2 GiB of f32
                      .arena_decay = kGpt2Decay,
                      .arena_no_decay = kGpt2NoDecay,
                      .ce_rows = 8192,
                      .ce_cols = 50257};
constexpr Sizes kQuick{.copy_bytes = 64LL << 20,
                       .accumulate_n = 4LL << 20,
                       .norm_n = 4LL << 20,
                       .arena_decay = 768 * 1000,
                       .arena_no_decay = 1344,
                       .ce_rows = 64,
                       .ce_cols = 50257};

struct Result {
  std::string name;
  std::string operands;  // what was run, in words
  double bytes = 0.0;    // Note [Bytes moved]
  Timing timing;
  double target = 0.0;   // the least ratio to the copy bandwidth; 0: none
  bool checked = false;  // its result matched the CPU reference
};

// [begin, end) ranges of length k (clipped) at the start and end of [0, n), around its middle and
// around each extra point.
std::vector<std::pair<std::int64_t, std::int64_t>> check_ranges(std::int64_t n, std::int64_t k,
                                                                std::vector<std::int64_t> points = {}) {
  points.insert(points.begin(), n / 2);
  std::vector<std::pair<std::int64_t, std::int64_t>> out{{0, std::min(k, n)}};
  for (std::int64_t p : points) out.emplace_back(std::max<std::int64_t>(0, p - k / 2), std::min(n, p + k / 2));
  out.emplace_back(std::max<std::int64_t>(0, n - k), n);
  return out;
}

// A host copy of rows [b, e) of t (never a view of t, whatever t's device).
Tensor snapshot(const Tensor& t, std::int64_t b, std::int64_t e) { return t.slice(0, b, e).to(mb::kCPU).clone(); }

// A model whose parameters have the layout of GPT-2 small's arena: one matrix for every weight
// that decays, one vector for every parameter that does not.
class ArenaModel : public mb::nn::Module {
 public:
  ArenaModel(std::int64_t decay, std::int64_t no_decay, mb::Device device) {
    MB_CHECK(decay % 768 == 0, "[bench] the decay part must be a multiple of 768 wide rows");
    weight = mb::randn({decay / 768, 768}, {.device = device}) * 0.02;
    bias = mb::zeros({no_decay}, {.device = device});
    register_parameter("weight", &weight);
    register_parameter("bias", &bias);
  }
  Tensor weight;  // (decay / 768, 768)
  Tensor bias;    // (no_decay)
};

// ---- copy -------------------------------------------------------------------------------------

Result bench_copy(mb::Device dev, const Sizes& s, int warmup, int reps) {
  Tensor a = mb::full({s.copy_bytes}, 1.0, {.dtype = DType::u8, .device = dev});
  Tensor b = mb::empty({s.copy_bytes}, {.dtype = DType::u8, .device = dev});
  const std::size_t n = static_cast<std::size_t>(s.copy_bytes);
  Result r{.name = "copy", .operands = fmt::format("{} MiB device to device", s.copy_bytes >> 20),
           .bytes = 2.0 * static_cast<double>(n)};
  r.timing = mb::bench::time_reps(dev, warmup, reps, [&] {
    if (dev.is_cuda()) {
      MB_CUDA_CHECK(cudaMemcpyAsync(b.raw_data(), a.raw_data(), n, cudaMemcpyDeviceToDevice,
                                    mb::kernels::cuda::current_stream()));
    } else {
      std::memcpy(b.raw_data(), a.raw_data(), n);
    }
  });
  mb::bench::device_sync(dev);
  r.checked = b.slice(0, 0, 16).to(DType::f32).to_vector() == std::vector<double>(16, 1.0) &&
              b.slice(0, s.copy_bytes - 16, s.copy_bytes).to(DType::f32).to_vector() == std::vector<double>(16, 1.0);
  if (!r.checked) std::printf("  CHECK FAILED copy: the destination does not hold the source\n");
  return r;
}

// ---- accumulate -------------------------------------------------------------------------------

Result bench_accumulate(mb::Device dev, const Sizes& s, DType src_dtype, int warmup, int reps) {
  const std::int64_t n = s.accumulate_n;
  const double w = 0.25;
  Tensor dst = mb::randn({n}, {.device = dev});       // (n) f32
  Tensor src = mb::randn({n}, {.device = dev}).to(src_dtype);  // (n)
  const std::string name = fmt::format("accumulate_f32_{}", mb::dtype_name(src_dtype));
  Result r{.name = name,
           .operands = fmt::format("f32 ({}) += {} * {} ({})", n, w, mb::dtype_name(src_dtype), n),
           .bytes = static_cast<double>(n) * (8.0 + static_cast<double>(mb::dtype_size(src_dtype)))};

  std::printf("%s\n", name.c_str());
  r.checked = true;
  const auto ranges = check_ranges(n, 4099);
  std::vector<Tensor> ref;
  for (auto [b, e] : ranges) {
    Tensor d = snapshot(dst, b, e);
    mb::accumulate_(d, snapshot(src, b, e), w);
    ref.push_back(d);
  }
  mb::accumulate_(dst, src, w);
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const auto want = ref[i].to_vector();
    // The CPU rounds w * src before adding; a device may fuse the multiply-add: one rounding apart.
    r.checked &= check_close(fmt::format("{}[{}:{}]", name, ranges[i].first, ranges[i].second),
                             dst.slice(0, ranges[i].first, ranges[i].second).to_vector(), want, 1e-6,
                             1e-7 * mb::bench::max_abs(want));
  }
  r.timing = mb::bench::time_reps(dev, warmup, reps, [&] { mb::accumulate_(dst, src, w); });
  return r;
}

// ---- gradient norm and non-finite flag ---------------------------------------------------------

// The device's one-launch reduction (kernels::cuda::sum_squares, Note [One-launch reduction] in
// kernels/optim.h) over a 2 GiB f32 arena; its result stays on the device, as in a boundary step.
Result bench_norm(mb::Device dev, const Sizes& s, int warmup, int reps) {
  const std::int64_t n = s.norm_n;
  Tensor values = mb::randn({n}, {.device = dev}) * 1e-2;  // (n) f32
  Tensor buffer = mb::zeros({static_cast<std::int64_t>(sizeof(mb::kernels::GradStatsBuffer))},
                            {.dtype = DType::u8, .device = dev});
  auto* stats = static_cast<mb::kernels::GradStatsBuffer*>(buffer.raw_data());
  auto reduce = [&] {
    if (dev.is_cuda()) {
      mb::kernels::cuda::sum_squares(values.kview(), stats);
    } else {
      const mb::kernels::cpu::NormResult r = mb::kernels::cpu::sum_squares(values.kview());
      stats->result = {.sum_sq = r.sum_sq, .non_finite = r.non_finite ? 1u : 0u};
    }
  };
  auto result = [&] {
    const Tensor host = buffer.slice(0, 0, sizeof(mb::kernels::GradStats)).to(mb::kCPU);
    mb::kernels::GradStats g;
    std::memcpy(&g, host.raw_data(), sizeof g);
    return g;
  };
  Result r{.name = "grad_norm",
           .operands = fmt::format("sum of squares (f64), non-finite flag and first index of f32 ({})", n),
           .bytes = 4.0 * static_cast<double>(n)};

  std::printf("grad_norm\n");
  const mb::kernels::cpu::NormResult want = mb::kernels::cpu::sum_squares(values.to(mb::kCPU).kview());
  reduce();
  mb::kernels::GradStats got = result();
  // Both sum exact f64 squares, in different orders.
  r.checked = check_close("grad_norm sum of squares", {got.sum_sq}, {want.sum_sq}, 1e-9, 0.0);
  if (got.non_finite != 0 || (dev.is_cuda() && got.first_non_finite != -1)) {
    std::printf("  CHECK FAILED grad_norm: non-finite flag %u, first index %lld on finite values\n",
                got.non_finite, static_cast<long long>(got.first_non_finite));
    r.checked = false;
  }
  // A NaN in the last element (the far end of the arena) must set the flag and name that index.
  Tensor last = values.slice(0, n - 1, n);
  const double saved = last.item();
  last.fill_(std::numeric_limits<double>::quiet_NaN());
  reduce();
  got = result();
  if (got.non_finite != 1 || (dev.is_cuda() && got.first_non_finite != n - 1)) {
    std::printf("  CHECK FAILED grad_norm: a NaN at %lld gave flag %u, first index %lld\n",
                static_cast<long long>(n - 1), got.non_finite, static_cast<long long>(got.first_non_finite));
    r.checked = false;
  } else {
    std::printf("  check %-40s ok\n", "grad_norm non-finite flag and index");
  }
  last.fill_(saved);
  r.timing = mb::bench::time_reps(dev, warmup, reps, reduce);
  return r;
}

// ---- AdamW over GPT-2 small's arena -------------------------------------------------------------

Result bench_adamw(mb::Device dev, const Sizes& s, int warmup, int reps) {
  ArenaModel model(s.arena_decay, s.arena_no_decay, dev);
  mb::optim::ParamStore store(model, {.compute_dtype = DType::bf16});
  const std::int64_t n = store.numel();
  const std::int64_t decay = store.decay_numel();
  MB_CHECK(decay == s.arena_decay, "[bench] decay range {} != {}", decay, s.arena_decay);
  Tensor grads = store.grads();  // (n) f32
  grads.copy_(mb::randn({n}, {.device = dev}) * 1e-2);
  const mb::optim::AdamWConfig config{.lr = 6e-4, .weight_decay = 0.1};
  mb::optim::AdamW adamw(store, config);

  // AdamW: one step first (moments become non-zero), then the checked step, then the timed ones.
  Result r{.name = "adamw",
           .operands = fmt::format("f32 master, grad, exp_avg, exp_avg_sq and bf16 weights ({}), decay on [0, {})",
                                   n, decay),
           .bytes = 30.0 * static_cast<double>(n)};
  std::printf("adamw\n");
  adamw.step();
  {
    const auto ranges = check_ranges(n, 4096, {decay});
    const auto state = adamw.state_dict();
    struct Slice {
      Tensor master, grad, m, v;
    };
    std::vector<Slice> before;
    for (auto [b, e] : ranges) {
      before.push_back({snapshot(store.master(), b, e), snapshot(grads, b, e), snapshot(state.at("exp_avg"), b, e),
                        snapshot(state.at("exp_avg_sq"), b, e)});
    }
    adamw.step();
    r.checked = true;
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const auto [b, e] = ranges[i];
      Slice& ref = before[i];
      Tensor work = mb::empty({e - b}, {.dtype = DType::bf16});
      const mb::kernels::AdamWArgs args{.lr = config.lr,
                                        .beta1 = config.beta1,
                                        .beta2 = config.beta2,
                                        .eps = config.eps,
                                        .weight_decay = config.weight_decay,
                                        .step = adamw.step_count(),
                                        .grad_scale = 1.0,
                                        .decay_end = std::clamp<std::int64_t>(decay - b, 0, e - b)};
      mb::kernels::cpu::adamw(ref.master.kview(), ref.grad.kview(), ref.m.kview(), ref.v.kview(), args, work.kview());
      const std::string at = fmt::format("[{}:{}]", b, e);
      auto close = [&](const std::string& what, const Tensor& got, const Tensor& want, double rtol) {
        const auto w = want.to_vector();
        return check_close(what + at, got.slice(0, b, e).to_vector(), w, rtol, 1e-6 * mb::bench::max_abs(w));
      };
      // f32 state within a few roundings (a device may fuse multiply-adds); the bf16 copy within
      // one bf16 rounding of the f32 master.
      r.checked &= close("adamw master", store.master(), ref.master, 1e-5);
      r.checked &= close("adamw exp_avg", state.at("exp_avg"), ref.m, 1e-5);
      r.checked &= close("adamw exp_avg_sq", state.at("exp_avg_sq"), ref.v, 1e-5);
      r.checked &= close("adamw bf16 weights", store.weights(), work, 8e-3);
    }
  }
  r.timing = mb::bench::time_reps(dev, warmup, reps, [&] { adamw.step(); });
  return r;
}

// ---- fused softmax + cross-entropy ---------------------------------------------------------------

struct CrossEntropyResults {
  Result forward, backward, both;
};

// padded: the logits' rows lie 16-byte aligned in a wider buffer, as a 16-bit linear on CUDA
// leaves GPT-2's (Note [Padded rows] in core/ops/linalg.cpp); else dense, rows off 16 bytes.
CrossEntropyResults bench_cross_entropy(mb::Device dev, const Sizes& s, int warmup, int reps,
                                        bool padded) {
  const std::int64_t rows = s.ce_rows, cols = s.ce_cols;
  const std::int64_t ld = padded ? (cols + 7) / 8 * 8 : cols;
  Tensor logits = mb::randn({rows, ld}, {.device = dev}).to(DType::bf16).slice(1, 0, cols).detach();
  logits.requires_grad_(true);  // (rows, cols), rows ld apart
  // Uniform targets; every 97th row ignored (row 0 among them).
  std::mt19937_64 gen(1234);
  std::uniform_int_distribution<std::int64_t> pick(0, cols - 1);
  std::vector<double> t(static_cast<std::size_t>(rows));
  std::int64_t counted = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    t[static_cast<std::size_t>(i)] = i % 97 == 0 ? -100.0 : static_cast<double>(pick(gen));
    counted += i % 97 == 0 ? 0 : 1;
  }
  Tensor target = mb::from_vector(t, {rows}, {.dtype = DType::i64}).to(dev);  // (rows)

  const double logit_count = static_cast<double>(rows) * static_cast<double>(cols);
  CrossEntropyResults out;
  const std::string operands = fmt::format("bf16 logits ({}, {}){}, i64 target, mean", rows, cols,
                                           padded ? fmt::format(" in rows of {}", ld) : "");
  const std::string suffix = padded ? "_padded" : "";
  out.forward = Result{.name = "cross_entropy_fwd" + suffix, .operands = operands,
                       .bytes = 2.0 * logit_count + 20.0 * static_cast<double>(rows)};
  out.backward = Result{.name = "cross_entropy_bwd" + suffix, .operands = operands,
                        .bytes = 4.0 * logit_count + 20.0 * static_cast<double>(rows)};
  // The target is the dense rows' (the layout PyTorch's figure is measured on).
  out.both = Result{.name = "cross_entropy_fwd_bwd" + suffix, .operands = operands,
                    .bytes = out.forward.bytes + out.backward.bytes, .target = padded ? 0.0 : 0.80};

  std::printf("cross_entropy%s\n", padded ? " (padded rows)" : "");
  {
    bool ok = true;
    Tensor per_row;  // (rows)
    {
      mb::NoGradGuard no_grad;
      per_row = mb::cross_entropy(logits, target, {.reduction = mb::Reduction::None});
    }
    Tensor loss = mb::cross_entropy(logits, target);
    Tensor dlogits = mb::grad({loss}, {Tensor()}, {logits})[0];  // (rows, cols) bf16
    // The mean of the row losses.
    const auto rows_loss = per_row.to_vector();
    double total = 0.0;
    for (double x : rows_loss) total += x;
    ok &= check_close("cross_entropy mean", {loss.item()}, {total / static_cast<double>(counted)}, 1e-2, 0.0);
    for (auto [b, e] : check_ranges(rows, 4, {rows / 3})) {
      Tensor x = snapshot(logits.detach(), b, e);
      x.requires_grad_(true);
      Tensor tx = snapshot(target, b, e);
      Tensor sum_loss = mb::cross_entropy(x, tx, {.reduction = mb::Reduction::Sum});
      Tensor dx = mb::grad({sum_loss}, {Tensor()}, {x})[0];
      Tensor want_rows;
      {
        mb::NoGradGuard no_grad;
        want_rows = mb::cross_entropy(x, tx, {.reduction = mb::Reduction::None});
      }
      const std::string at = fmt::format("[{}:{}]", b, e);
      // bf16 outputs on both sides: within a bf16 rounding or two (REFERENCE.md's bf16 rtol).
      ok &= check_close("cross_entropy rows" + at, per_row.slice(0, b, e).to_vector(), want_rows.to_vector(), 1.6e-2,
                        1e-5);
      std::vector<double> want = dx.to_vector();
      for (double& v : want) v /= static_cast<double>(counted);  // the mean's gradient
      ok &= check_close("cross_entropy dlogits" + at, dlogits.slice(0, b, e).to_vector(), want, 1.6e-2,
                        1e-3 * mb::bench::max_abs(want));
    }
    out.forward.checked = out.backward.checked = out.both.checked = ok;
  }

  // Each repetition: the forward between marks 0 and 1, the backward between 1 and 2. The backward
  // returns dlogits (microbatch::grad) rather than adding it into logits.grad, as a step's
  // backward hands it on to the head's GEMM.
  for (int i = 0; i < warmup; ++i) (void)mb::grad({mb::cross_entropy(logits, target)}, {Tensor()}, {logits});
  mb::bench::device_sync(dev);
  mb::bench::RepTimer timer(dev);
  std::vector<std::array<int, 3>> marks;
  for (int i = 0; i < reps; ++i) {
    const int a = timer.mark();
    Tensor loss = mb::cross_entropy(logits, target);
    const int b = timer.mark();
    (void)mb::grad({loss}, {Tensor()}, {logits});
    marks.push_back({a, b, timer.mark()});
  }
  std::vector<double> fwd, bwd, both;
  for (auto [a, b, c] : marks) {
    fwd.push_back(timer.ms(a, b));
    bwd.push_back(timer.ms(b, c));
    both.push_back(timer.ms(a, c));
  }
  out.forward.timing = mb::bench::summarize(fwd);
  out.backward.timing = mb::bench::summarize(bwd);
  out.both.timing = mb::bench::summarize(both);
  return out;
}

nlohmann::json to_json(const Result& r, double copy_gbps) {
  const double gbps = mb::bench::gb_per_s(r.bytes, r.timing.median_ms);
  const double ratio = copy_gbps > 0 ? gbps / copy_gbps : 0.0;
  nlohmann::json j{{"name", r.name},
                   {"operands", r.operands},
                   {"bytes", r.bytes},
                   {"median_ms", r.timing.median_ms},
                   {"min_ms", r.timing.min_ms},
                   {"max_ms", r.timing.max_ms},
                   {"reps", r.timing.reps},
                   {"gb_per_s", gbps},
                   {"ratio_to_copy", ratio},
                   {"checked", r.checked}};
  if (r.target > 0) {
    j["target"] = r.target;
    j["meets_target"] = ratio >= r.target;
  }
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  mb::bench::Args args(argc, argv);
  const std::string json_path = args.get("--json", "");
  const int reps = static_cast<int>(args.get_int("--reps", 20));
  const int warmup = static_cast<int>(args.get_int("--warmup", 3));
  const bool quick = args.flag("--quick");
  const std::string device_arg = args.get("--device", "cuda");
  if (!args.unknown().empty()) {
    std::fprintf(stderr, "bench_kernels_cuda: unknown argument '%s'\n"
                         "usage: bench_kernels_cuda [--json PATH] [--reps N] [--warmup N] [--quick] "
                         "[--device cuda|cpu]\n", args.unknown().c_str());
    return 2;
  }
  try {
    const mb::Device dev = mb::parse_device(device_arg);
    if (dev.is_cuda() && !mb::cuda_available()) {
      std::fprintf(stderr, "bench_kernels_cuda: no CUDA device here; nothing to measure "
                           "(--device cpu runs the program's logic on the CPU)\n");
      return 2;
    }
    const Sizes& sizes = quick || dev.is_cpu() ? kQuick : kFull;
    std::printf("bench_kernels_cuda on %s (%s sizes), median of %d after %d warm-up\n",
                mb::bench::device_name(dev).c_str(), &sizes == &kFull ? "full" : "quick", reps, warmup);

    // Each kernel fails alone: its exception is recorded under "errors" and the others still run
    // (a device fault is sticky, so after one every later kernel may fail too, each saying so).
    std::vector<Result> results;
    nlohmann::json errors = nlohmann::json::array();
    double copy_gbps = std::nan("");  // no ratios without it
    // kernels.json is written after every kernel, so that a run killed part-way (a hang, its time
    // box) still hands over what it measured ("complete": false); the table is printed once, at
    // the end, with the last write.
    bool all_checked = true, all_targets = true;
    enum class Run { going, complete };  // a rewrite after one kernel, or the last write
    auto write_report = [&](Run run) {
      const bool print = run == Run::complete;
      all_checked = all_targets = true;
      nlohmann::json kernels = nlohmann::json::array();
      if (print) {
        std::printf("\n%-30s %10s %10s %10s %8s %7s  %s\n", "kernel", "MB moved", "median ms",
                    "GB/s", "vs copy", "target", "check");
      }
      for (const Result& r : results) {
        nlohmann::json j = to_json(r, copy_gbps);
        kernels.push_back(j);
        all_checked &= r.checked;
        const bool meets = !j.contains("meets_target") || j["meets_target"].get<bool>();
        all_targets &= meets;
        if (!print) continue;
        std::printf("%-30s %10.1f %10.4f %10.1f %8.3f %7s  %s\n", r.name.c_str(), r.bytes / 1e6,
                    r.timing.median_ms, j["gb_per_s"].get<double>(),
                    j["ratio_to_copy"].get<double>(),
                    r.target > 0 ? fmt::format("{}{:.2f}", meets ? ">=" : "< ", r.target).c_str()
                                 : "-",
                    r.checked ? "ok" : "FAILED");
      }
      const mb::MemoryStats stats = mb::memory_stats(dev);
      mb::bench::write_json(json_path, {{"benchmark", "kernels"},
                                        {"implementation", "microbatch"},
                                        {"device", mb::bench::device_name(dev)},
                                        {"sizes", quick || dev.is_cpu() ? "quick" : "full"},
                                        {"reps", reps},
                                        {"warmup", warmup},
                                        {"copy_gb_per_s", copy_gbps},
                                        {"kernels", kernels},
                                        {"errors", errors},
                                        {"all_checked", all_checked && errors.empty()},
                                        {"all_targets_met", all_targets && errors.empty()},
                                        {"complete", run == Run::complete},
                                        {"peak_allocated_bytes", stats.allocated.peak},
                                        {"peak_reserved_bytes", stats.reserved.peak}});
    };
    auto attempt = [&](const char* name, auto&& run) {
      try {
        run();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_kernels_cuda: %s failed: %s\n", name, e.what());
        errors.push_back({{"name", name}, {"error", e.what()}});
        try {
          mb::empty_cache(dev);
        } catch (const std::exception&) {
        }
      }
      try {
        write_report(Run::going);
      } catch (const std::exception& e) {  // the last write, after every kernel, says it again
        std::fprintf(stderr, "bench_kernels_cuda: %s\n", e.what());
      }
    };
    attempt("copy", [&] {
      results.push_back(bench_copy(dev, sizes, warmup, reps));
      copy_gbps = mb::bench::gb_per_s(results.back().bytes, results.back().timing.median_ms);
    });
    for (DType src : {DType::f32, DType::bf16}) {
      attempt(src == DType::f32 ? "accumulate_f32_f32" : "accumulate_f32_bf16", [&] {
        results.push_back(bench_accumulate(dev, sizes, src, warmup, reps));
        results.back().target = 0.90;
      });
    }
    attempt("grad_norm", [&] {
      results.push_back(bench_norm(dev, sizes, warmup, reps));
      results.back().target = 0.80;
    });
    attempt("adamw", [&] {
      results.push_back(bench_adamw(dev, sizes, warmup, reps));
      results.back().target = 0.85;
    });
    for (bool padded : {false, true}) {
      attempt(padded ? "cross_entropy (padded rows)" : "cross_entropy", [&] {
        // AdamW's arena back to the device before the logits; inside the attempt, so that a device
        // fault it meets is this kernel's error and kernels.json is still written.
        mb::empty_cache(dev);
        CrossEntropyResults ce = bench_cross_entropy(dev, sizes, warmup, reps, padded);
        results.push_back(ce.forward);
        results.push_back(ce.backward);
        results.push_back(ce.both);
        mb::empty_cache(dev);
      });
    }

    write_report(Run::complete);
    if (!errors.empty()) {
      std::printf("%zu kernel(s) failed to run (see above)\n", errors.size());
    }
    if (!all_checked) {
      std::printf("some kernels disagree with the CPU reference (see CHECK FAILED above)\n");
    }
    return all_checked && errors.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kernels_cuda: %s\n", e.what());
    return 1;
  }
}
