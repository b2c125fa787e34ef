// bench_gpt2_cuda: training steps of GPT-2 small (124M parameters: vocab 50257, block 1024, 12
// layers, 12 heads, 768 wide, head tied to the token embedding) on one GPU, as a user's raw loop
// runs them: bf16 working weights with f32 master weights and f32 gradients (ParamStore),
// forward, backward, global-norm clipping to 1.0, AdamW (lr 6e-4, weight decay 0.1 on matrices,
// betas (0.9, 0.999), eps 1e-8). One micro-batch of B sequences of T = 1024 tokens per optimizer
// step, for each B in --batch; the batch is drawn once per B (seeded uniform tokens) and reused.
//
//   bench_gpt2_cuda [--json PATH] [--out-dir DIR] [--batch 8,16] [--steps 10] [--warmup 3]
//                   [--device cuda|cpu] [--model gpt2|char|tiny] [--precision bf16|f32]
//                   [--profile] [--profile-steps 3] [--profile-out PATH]
//
// It writes the initial weights to DIR/gpt2_init.safetensors (with the model's name and shape in
// the metadata) and each batch to DIR/gpt2_tokens.safetensors ("tokens_b8": (8, 1025) i64, ...),
// so that benchmarks/torch_gpt2.py starts from the same weights and sees the same tokens: the two
// runs' losses should agree step for step (bf16 rounding aside). --model char is the README's
// character-level GPT (vocab 65, block 64, 4 layers, 4 heads, 128 wide), the model of the CPU
// comparison (benchmarks/cpu_vs_torch.sh, with --precision f32: f32 weights, no 16-bit copy);
// --model tiny (or --tiny) is 2 layers, 64 wide, on 64 tokens (with --device cpu, a smoke run of
// this program's logic).
//
// The steps run as the Trainer runs them: the boundary step (norm, clip and AdamW, one launch
// each) is queued without a host synchronisation and its outcome read at the next boundary; the
// losses are read at the end. A step's time is the median over --steps steps after --warmup,
// between two cudaEvents on the current stream; step_ms_mean_span is the timed steps' whole span
// on the stream divided by their number (gaps between steps included). Memory: the allocator's peak
// allocated and reserved bytes since the model was built (memory_stats); cuBLAS's workspace is
// taken by cudaMalloc outside the allocator and is not in them. On the CPU also the growth of the
// process's resident memory: its peak over the steps less its size before the run's model was
// built (host_rss_growth_bytes), which torch_gpt2.py measures alike for PyTorch.
//
// --profile runs --profile-steps more steps per batch size after the timed ones, their figures
// already taken, with the op profiler on (core/profiler.h), and prints the table: calls and self
// time per op, forward and backward, on the host and on the stream. --profile-out also writes the
// tables to PATH; --json gets them as "profile" in each run.
//
// A batch size whose run throws (out of memory at B = 16, say) is recorded in the JSON as
// {"batch", "error"}, its failed profiled steps as that run's "profile_error" beside its figures,
// and the other batch sizes still run; the JSON and --profile-out are rewritten after every run, so
// that figures once measured survive a later failure or a time box. The exit status is then 1;
// 2 for arguments it cannot use.
//
// Under a launcher (`mpirun -np W bench_gpt2_cuda ...`; Note [Data parallel] in
// train/distributed.h) the W processes train data-parallel, as benchmarks/torch_gpt2.py does under
// torchrun: B stays the whole batch of a step, each rank takes B / W of its rows (rank r the r-th
// run of them) on its own device (cuda:(local rank), or the CPU), backward weighs its mean loss
// by 1 / W, and the gradients are summed over the ranks (MPI on the CPU, NCCL on GPUs) before the
// boundary step. Rank 0 alone writes the files and prints; the losses reported are the means over
// the ranks, and the memory figures rank 0's. The steps are timed on rank 0, the sum included.
// --profile is for one process. A failure on any rank ends every rank (MPI_Abort), the batch
// sizes after it not run; rank 0 writes its JSON first when the failure is its own.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "benchmarks/bench_util.h"
#include "core/profiler.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "kernels/attention.h"
#include "nn/models.h"
#include "optim/boundary_step.h"
#include "optim/optimizer.h"
#include "optim/param_store.h"
#include "optim/schedule.h"
#include "train/distributed.h"

namespace mb = microbatch;
using mb::DType;
using mb::Tensor;

namespace {

mb::nn::GPTConfig gpt2_small() {
  return {.vocab_size = 50257, .block_size = 1024, .n_layer = 12, .n_head = 12, .n_embd = 768};
}

mb::nn::GPTConfig tiny() {
  return {.vocab_size = 512, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 64};
}

mb::nn::GPTConfig char_gpt() {
  return {.vocab_size = 65, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128};
}

// --model's name to its config, and the name the JSON and the weights' metadata carry.
std::pair<std::string, mb::nn::GPTConfig> model_named(const std::string& name) {
  if (name == "gpt2") return {"gpt2_small", gpt2_small()};
  if (name == "char") return {"char", char_gpt()};
  if (name == "tiny") return {"tiny", tiny()};
  mb::detail::throw_error(fmt::format("--model {}: expected gpt2, char or tiny", name));
}

// (B, T + 1) uniform token ids in [0, vocab), from a seeded generator.
Tensor synthetic_tokens(std::int64_t batch, std::int64_t t, std::int64_t vocab,
                        std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<std::int64_t> pick(0, vocab - 1);
  std::vector<double> ids(static_cast<std::size_t>(batch * (t + 1)));
  for (double& id : ids) id = static_cast<double>(pick(gen));
  return mb::from_vector(ids, {batch, t + 1}, {.dtype = DType::i64});
}

// Which attention kernel the steps ran: the fused CUDA ones (tensor cores for bf16 unless
// MB_ATTENTION_KERNEL=simt, or where they cannot run) or the composed CPU path.
const char* attention_kernel_name(mb::Device dev) {
  if (!dev.is_cuda()) return "composed (CPU)";
  if (mb::kernels::cuda::attention_kernel() == mb::kernels::cuda::AttentionKernel::simt)
    return "fused, f32 math (MB_ATTENTION_KERNEL=simt)";
  return mb::kernels::cuda::tensor_core_attention_here()
             ? "fused, tensor cores"
             : "fused, f32 math (no tensor-core attention on this device)";
}

struct Run {
  std::int64_t batch = 0;
  std::string error;  // why the run stopped; a failed run records nothing else
  mb::bench::Timing step;
  std::vector<double> losses;  // every step's loss, warm-up included
  std::vector<double> grad_norms;
  double wall_ms = 0.0;  // the timed steps' span on the stream, per step
  std::int64_t peak_allocated = 0, peak_reserved = 0;
  mb::bench::ResidentGrowth rss;  // on the CPU, where Linux gives the figures
  nlohmann::json profile;  // ProfileReport::to_json() of the profiled steps, and "steps"; or null
  std::string profile_error;  // why the profiled steps stopped; the figures above stand
};

double tokens_per_s(const Run& r, std::int64_t t) {
  return static_cast<double>(r.batch * t) / (r.step.median_ms * 1e-3);
}

// One entry of the JSON's "runs": {"batch", "error"} for a run that failed.
nlohmann::json run_json(const Run& r, std::int64_t t) {
  if (!r.error.empty()) return {{"batch", r.batch}, {"error", r.error}};
  nlohmann::json j = {{"batch", r.batch},
                      {"seq_len", t},
                      {"tokens_per_step", r.batch * t},
                      {"step_ms_median", r.step.median_ms},
                      {"step_ms_min", r.step.min_ms},
                      {"step_ms_max", r.step.max_ms},
                      {"steps_timed", r.step.reps},
                      {"step_ms_mean_span", r.wall_ms},
                      {"tokens_per_s", tokens_per_s(r, t)},
                      {"peak_allocated_bytes", r.peak_allocated},
                      {"peak_reserved_bytes", r.peak_reserved},
                      {"losses", r.losses},
                      {"grad_norms", r.grad_norms}};
  r.rss.add_to(j);
  if (!r.profile.is_null()) j["profile"] = r.profile;
  if (!r.profile_error.empty()) j["profile_error"] = r.profile_error;
  return j;
}

constexpr const char* kUsage =
    "usage: bench_gpt2_cuda [--json PATH] [--out-dir DIR] [--batch 8,16] [--steps N] [--warmup N]\n"
    "                       [--device cuda|cpu] [--model gpt2|char|tiny] [--precision bf16|f32]\n"
    "                       [--profile] [--profile-steps N] [--profile-out PATH]\n"
    "  (under mpirun -np W: data-parallel over W processes, B rows a step in all)\n";

}  // namespace

int main(int argc, char** argv) {
  mb::bench::Args args(argc, argv);
  const std::string json_path = args.get("--json", "");
  const std::string out_dir = args.get("--out-dir", ".");
  const std::string device_arg = args.get("--device", "cuda");
  const bool tiny_flag = args.flag("--tiny");
  const std::string model_arg = args.get("--model", tiny_flag ? "tiny" : "gpt2");
  const std::string precision = args.get("--precision", "bf16");
  const std::string profile_out = args.get("--profile-out", "");
  const bool profile =
      args.flag("--profile") || !profile_out.empty() || mb::profiler::requested_by_env();
  std::vector<std::int64_t> batches;
  int steps = 0, warmup = 0, profile_steps = 0;
  mb::Device dev = mb::kCPU;
  try {
    batches = mb::bench::parse_sizes(args.get("--batch", "8,16"), "bench_gpt2_cuda");
    steps = static_cast<int>(args.get_int("--steps", 10));
    warmup = static_cast<int>(args.get_int("--warmup", 3));
    profile_steps = static_cast<int>(args.get_int("--profile-steps", 3));
    dev = mb::parse_device(device_arg);
    MB_CHECK(!tiny_flag || model_arg == "tiny", "--tiny and --model {} name two models", model_arg);
    (void)model_named(model_arg);
    MB_CHECK(precision == "bf16" || precision == "f32", "--precision {}: expected bf16 or f32",
             precision);
  } catch (const mb::Error& e) {
    std::fprintf(stderr, "bench_gpt2_cuda: %s\n%s", e.what(), kUsage);
    return 2;
  } catch (const std::logic_error& e) {  // std::stoll's; its message names only itself
    std::fprintf(stderr,
                 "bench_gpt2_cuda: --batch, --steps, --warmup and --profile-steps take whole "
                 "numbers (%s)\n%s",
                 e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpt2_cuda: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (steps < 1 || warmup < 0 || profile_steps < 1) {
    std::fprintf(stderr,
                 "bench_gpt2_cuda: --steps and --profile-steps must be >= 1 and --warmup >= 0\n");
    return 2;
  }
  if (!args.unknown().empty()) {
    std::fprintf(stderr, "bench_gpt2_cuda: unknown argument '%s'\n%s", args.unknown().c_str(),
                 kUsage);
    return 2;
  }
  if (dev.is_cuda() && !mb::cuda_available()) {
    std::fprintf(stderr,
                 "bench_gpt2_cuda: no CUDA device here; nothing to measure "
                 "(--device cpu --tiny runs the program's logic on the CPU)\n");
    return 2;
  }
  mb::train::ProcessGroup* world_group = nullptr;
  try {
    world_group = &mb::train::ProcessGroup::world();
  } catch (const std::exception& e) {  // launched as several processes by a build without MPI
    std::fprintf(stderr, "bench_gpt2_cuda: %s\n", e.what());
    return 2;
  }
  mb::train::ProcessGroup& group = *world_group;
  const int world = group.size();
  if (world > 1) {
    // An argument refused here is refused on every rank alike: each prints it and stops.
    std::string refused;
    if (profile) refused = "--profile is for one process, not a data-parallel run";
    for (std::int64_t b : batches)
      if (b % world != 0)
        refused = fmt::format("--batch {} does not split over the {} processes", b, world);
    if (!refused.empty()) {
      if (group.is_main()) std::fprintf(stderr, "bench_gpt2_cuda: %s\n", refused.c_str());
      group.finalize();
      return 2;
    }
    try {
      // `--device cuda:N` keeps N on every rank; `cuda` is cuda:(local rank).
      const auto index = device_arg.find(':') != std::string::npos
                             ? mb::train::DeviceIndex::Named
                             : mb::train::DeviceIndex::Default;
      dev = mb::train::prepare_rank(group, dev, index, "auto");
    } catch (const std::exception& e) {
      // Refused on every rank (Note [Failing together]): said once; else this rank's own error.
      const bool shared = mb::train::ProcessGroup::shared(std::current_exception());
      if (!shared || group.is_main())
        std::fprintf(stderr, "bench_gpt2_cuda: rank %d: %s\n", group.rank(), e.what());
      if (!shared) mb::train::ProcessGroup::abort_if_distributed(1);
      group.finalize(mb::train::ProcessGroup::Ending::AfterError);
      return 1;
    }
  }
  const bool main_rank = group.is_main();
  const auto [model_name, config] = model_named(model_arg);
  const DType compute_dtype = precision == "f32" ? DType::f32 : DType::bf16;
  const std::int64_t T = config.block_size;

  // Whatever fails from here on, the JSON and --profile-out are written with what was measured: a
  // failure before the runs is the JSON's "error", a run's failure that run's "error" (the other
  // batch sizes still run), and the exit status is 1.
  nlohmann::json report = {
      {"benchmark", "gpt2"},
      {"implementation", "microbatch"},
      {"device", device_arg},
      {"model", model_name},
      {"precision", compute_dtype == DType::f32
                        ? "f32 weights, activations and gradients"
                        : "bf16 weights and activations, f32 master weights and gradients"},
      {"optimizer",
       "AdamW lr 6e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.1 on matrices; clip 1.0"},
      {"attention", attention_kernel_name(dev)},
      {"batches", batches},
      {"processes", world},
      {"warmup", warmup},
      {"runs", nlohmann::json::array()}};
  std::vector<Run> runs;
  std::string profile_tables;  // each batch size's table, or why it has none
  bool failed = false;
  // Rewritten after every run, so that a later run's crash or the check's time box does not take
  // the figures of the earlier ones with it.
  auto write_outputs = [&] {
    if (!main_rank) return;
    report["runs"] = nlohmann::json::array();
    for (const Run& r : runs) report["runs"].push_back(run_json(r, T));
    try {
      mb::bench::write_json(json_path, report);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_gpt2_cuda: %s\n", e.what());
      failed = true;
    }
    if (profile_out.empty()) return;
    std::ofstream out(profile_out);
    out << profile_tables;
    if (!out.good()) {
      std::fprintf(stderr, "bench_gpt2_cuda: could not write %s\n", profile_out.c_str());
      failed = true;
    }
  };

  try {
    report["device"] = mb::bench::device_name(dev);
#if defined(_OPENMP)
    if (!dev.is_cuda()) report["threads"] = omp_get_max_threads();  // the CPU kernels' OpenMP team
#endif
    std::filesystem::create_directories(out_dir);

    // The model, built and initialized on the CPU (GPT-2's init), then its weights exported; each
    // batch size trains a model of its own from them.
    mb::manual_seed(42);
    std::int64_t n_params = 0;
    mb::nn::StateDict initial;
    {
      mb::nn::GPT model(config);
      n_params = model.num_parameters();
      initial = model.state_dict();
    }
    report["parameters"] = n_params;
    const std::string weights_path =
        (std::filesystem::path(out_dir) / "gpt2_init.safetensors").string();
    // Every rank builds the same weights from the seed; rank 0 writes them.
    if (main_rank)
      mb::save_safetensors(weights_path, initial,
                           {{"model", model_name},
                            {"vocab_size", std::to_string(config.vocab_size)},
                            {"block_size", std::to_string(config.block_size)},
                            {"n_layer", std::to_string(config.n_layer)},
                            {"n_head", std::to_string(config.n_head)},
                            {"n_embd", std::to_string(config.n_embd)}});
    report["weights"] = weights_path;
    if (main_rank)
      std::printf("GPT %s (%s): %lld parameters on %s; initial weights in %s%s\n",
                  model_name.c_str(), precision.c_str(), static_cast<long long>(n_params),
                  mb::bench::device_name(dev).c_str(), weights_path.c_str(),
                  world > 1 ? fmt::format("; {} processes", world).c_str() : "");

    mb::NamedTensorMap tokens;
    for (std::int64_t b : batches)
      tokens["tokens_b" + std::to_string(b)] =
          synthetic_tokens(b, T, config.vocab_size, 1000 + static_cast<std::uint64_t>(b));
    const std::string tokens_path =
        (std::filesystem::path(out_dir) / "gpt2_tokens.safetensors").string();
    if (main_rank) mb::save_safetensors(tokens_path, tokens);
    report["tokens"] = tokens_path;

    const mb::optim::AdamWConfig adamw_config{.lr = 6e-4, .weight_decay = 0.1};
    const double max_grad_norm = 1.0;

    for (std::int64_t B : batches) {
      Run run{.batch = B};
      try {
        // Every batch size starts from the same weights, with a model, arenas and moments of its
        // own and an empty cache, as torch_gpt2.py builds its model per batch size. The resident
        // memory before the model is the baseline of the CPU runs' memory figure.
        mb::empty_cache(dev);
        mb::bench::release_free_heap();
        const mb::bench::ResidentMemory before = mb::bench::resident_memory();
        mb::nn::GPT model(config);
        model.load_state_dict(initial);
        model.to(dev);
        mb::optim::ParamStore store(model, {.compute_dtype = compute_dtype});
        mb::reset_peak_memory_stats(dev);
        mb::optim::AdamW adamw(store, adamw_config);
        // This rank's rows of the step's B (all of them in one process).
        const Tensor batch =
            tokens.at("tokens_b" + std::to_string(B))
                .slice(0, group.rank() * (B / world), (group.rank() + 1) * (B / world));
        const Tensor inputs = batch.slice(1, 0, T).contiguous().to(dev);      // (B, T)
        const Tensor labels = batch.slice(1, 1, T + 1).contiguous().to(dev);  // (B, T)

        mb::optim::LRScheduler schedule(adamw, {.type = mb::optim::ScheduleType::Constant});
        mb::optim::BoundaryStep boundary(store, adamw, schedule, nullptr,
                                         {.max_grad_norm = max_grad_norm});

        // As the Trainer runs: nothing waits for the device inside a step; the boundary step's
        // outcome (the norm) is read one step later, the losses at the end.
        mb::bench::RepTimer timer(dev);
        std::vector<std::pair<int, int>> marks;
        std::vector<Tensor> losses;  // () each, on the device
        Tensor grads = store.grads();
        // The peak counts from here: the transient second copy of the weights while the store
        // took them over is not training's (PyTorch's model has none).
        const bool rss_peak_reset = !dev.is_cuda() && mb::bench::reset_resident_peak();
        for (int i = 0; i < warmup + steps; ++i) {
          const int a = timer.mark();
          store.zero_grad();
          Tensor loss = model(inputs, labels).loss;
          if (world == 1) {
            loss.backward();
          } else {
            // The mean over the ranks' rows: each rank's mean weighed by 1 / W, then summed.
            (loss * (1.0 / world)).backward();
            group.all_reduce_sum(grads);
          }
          for (const mb::optim::StepOutcome& o : boundary.step(i + 1, mb::optim::Settle::Later))
            run.grad_norms.push_back(o.grad_norm);
          marks.emplace_back(a, timer.mark());
          losses.push_back(loss.detach());
        }
        for (const mb::optim::StepOutcome& o : boundary.settle())
          run.grad_norms.push_back(o.grad_norm);
        std::vector<double> ms;
        for (std::size_t i = 0; i < marks.size(); ++i) {
          const double ms_step = timer.ms(marks[i].first, marks[i].second);
          if (i >= static_cast<std::size_t>(warmup)) ms.push_back(ms_step);
          const double loss = losses[i].item();
          run.losses.push_back(world == 1 ? loss : group.all_reduce_sum(loss) / world);
          const double norm = i < run.grad_norms.size() ? run.grad_norms[i] : std::nan("");
          if (main_rank)
            std::printf("  B=%lld step %2zu: loss %.4f, grad norm %.3f, %.1f ms%s\n",
                        static_cast<long long>(B), i, run.losses.back(), norm, ms_step,
                        i < static_cast<std::size_t>(warmup) ? " (warm-up)" : "");
        }
        run.wall_ms =
            timer.ms(marks[static_cast<std::size_t>(warmup)].first, marks.back().second) / steps;
        run.step = mb::bench::summarize(ms);
        const mb::MemoryStats stats = mb::memory_stats(dev);
        run.peak_allocated = stats.allocated.peak;
        run.peak_reserved = stats.reserved.peak;
        run.rss = mb::bench::resident_growth(before, rss_peak_reset);

        if (profile) {
          // The same steps as above, after the timed ones, with the profiler on; the profiler's
          // events and its final wait touch none of the figures above, which stand if these fail.
          try {
            mb::bench::device_sync(dev);
            mb::profiler::start();
            for (int i = 0; i < profile_steps; ++i) {
              store.zero_grad();
              Tensor loss = model(inputs, labels).loss;
              loss.backward();
              (void)boundary.step(warmup + steps + i + 1, mb::optim::Settle::Later);
            }
            mb::profiler::stop();  // waits for the device
            const mb::profiler::ProfileReport profiled = mb::profiler::report();
            (void)boundary.settle();
            const std::string table = fmt::format(
                "\nB={}: time per op over {} profiled steps ({:.1f} ms of wall clock per step)\n{}",
                B, profile_steps, profiled.span_ms / profile_steps, profiled.table());
            std::printf("%s", table.c_str());
            profile_tables += table;
            run.profile = profiled.to_json();
            run.profile["steps"] = profile_steps;
          } catch (const std::exception& e) {
            // Recording left on would slow the next batch size's timed steps.
            try {
              mb::profiler::stop();
            } catch (const std::exception&) {
              // The device error that stop() met is the one reported below.
            }
            run.profile_error = e.what();
            std::fprintf(stderr, "bench_gpt2_cuda: B=%lld: the profiled steps failed: %s\n",
                         static_cast<long long>(B), e.what());
            profile_tables += fmt::format("\nB={}: the profiled steps failed: {}\n", B, e.what());
            failed = true;
          }
        }
      } catch (const std::exception& e) {
        run.error = e.what();
        std::fprintf(stderr, "bench_gpt2_cuda: B=%lld failed: %s\n", static_cast<long long>(B),
                     e.what());
        if (profile)
          profile_tables += fmt::format("\nB={}: not profiled, the run failed: {}\n", B, e.what());
        failed = true;
        if (world > 1) {
          // The other ranks wait in a collective this rank left: the run ends here, rank 0's JSON
          // written first when the failure is its own.
          runs.push_back(std::move(run));
          write_outputs();
          mb::train::ProcessGroup::abort_if_distributed(1);
        }
      }
      runs.push_back(std::move(run));
      write_outputs();
    }
  } catch (const std::exception& e) {
    report["error"] = e.what();
    std::fprintf(stderr, "bench_gpt2_cuda: %s\n", e.what());
    if (profile) profile_tables += fmt::format("\nnot profiled: {}\n", e.what());
    failed = true;
    if (world > 1) {
      write_outputs();
      mb::train::ProcessGroup::abort_if_distributed(1);
    }
  }

  if (!runs.empty() && main_rank)
    std::printf("\n%6s %12s %12s %14s %14s %14s %10s\n", "batch", "step ms", "tokens/s",
                "peak alloc", "peak reserved", "RSS growth", "last loss");
  for (const Run& r : runs) {
    if (!main_rank) break;
    if (!r.error.empty()) {
      std::printf("%6lld   failed: %s\n", static_cast<long long>(r.batch), r.error.c_str());
      continue;
    }
    std::printf("%6lld %12.1f %12.0f %14s %14s %14s %10.4f\n", static_cast<long long>(r.batch),
                r.step.median_ms, tokens_per_s(r, T), mb::format_bytes(r.peak_allocated).c_str(),
                mb::format_bytes(r.peak_reserved).c_str(), r.rss.text().c_str(), r.losses.back());
  }
  write_outputs();
  group.finalize();
  return failed ? 1 : 0;
}
