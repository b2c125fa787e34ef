// bench_image_cuda: training steps of the Fashion-MNIST models (nn/models.h: the MLP
// 784-256-128-10, 235,146 parameters, and the CNN conv3x3(32)-pool-conv3x3(64)-pool-128-10,
// 421,642) as a user's raw loop runs them, so that benchmarks/torch_image.py can run the same steps
// in PyTorch: f32 weights, activations and gradients; forward, backward, global-norm clipping
// to 1.0, AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on tensors of two or more
// dims). Each optimizer step takes the next B training images, in the file's order, for each B in
// --batch.
//
//   bench_image_cuda [--json PATH] [--out-dir DIR] [--model mlp|cnn] [--batch 64,256]
//                    [--steps 30] [--warmup 3] [--device cpu|cuda] [--data DIR|synthetic]
//
// It writes the initial weights to DIR/image_<model>_init.safetensors (the model's name in the
// metadata) and every step's images and labels to DIR/image_<model>_batches.safetensors
// ("inputs_b64": (S * 64, 28, 28) f32 pixels / 255 and "labels_b64": (S * 64) i64, S = warm-up +
// timed steps), so that the two runs' losses should agree step for step (f32 sums in other orders
// aside). --data is the folder of Fashion-MNIST's IDX files (Debian's dataset-fashion-mnist
// installs them in /usr/share/datasets/fashion-mnist, the default); `synthetic` draws seeded
// uniform pixels and labels instead (a run's logic without the dataset; its losses stay near ln
// 10).
//
// Figures, as bench_gpt2_cuda's: a step's time is the median over --steps after --warmup (host time
// on the CPU, cudaEvents on the current stream on a GPU); the boundary step is queued without a
// host synchronisation and its outcome read at the next boundary; the losses are read at the end.
// Memory: the allocator's peak allocated and reserved bytes since the model was built and, on the
// CPU, the growth of the process's resident memory over the steps (host_rss_growth_bytes,
// bench_util.h), which torch_image.py measures alike for PyTorch. A batch size whose run throws is
// recorded as {"batch", "error"} and the others still run; the JSON is rewritten after every run;
// the exit status is then 1, and 2 for arguments it cannot use.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "benchmarks/bench_util.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "nn/models.h"
#include "optim/boundary_step.h"
#include "optim/optimizer.h"
#include "optim/param_store.h"
#include "optim/schedule.h"
#include "train/fashion_mnist.h"

namespace mb = microbatch;
using mb::DType;
using mb::Tensor;

namespace {

constexpr const char* kUsage =
    "usage: bench_image_cuda [--json PATH] [--out-dir DIR] [--model mlp|cnn] [--batch 64,256]\n"
    "                        [--steps N] [--warmup N] [--device cpu|cuda] [--data DIR|synthetic]\n";

constexpr std::int64_t kSide = mb::train::FashionMNIST::kRows;  // 28 x 28 images
constexpr std::int64_t kPixels = kSide * mb::train::FashionMNIST::kCols;

// --model's name to a freshly built model with the default config (nn/models.h).
std::shared_ptr<mb::nn::Model> make_model(const std::string& name) {
  if (name == "mlp") return std::make_shared<mb::nn::MLP>();
  if (name == "cnn") return std::make_shared<mb::nn::CNN>();
  mb::detail::throw_error(fmt::format("--model {}: expected mlp or cnn", name));
}

// The images and labels of `rows` training examples: the dataset's first ones in its order (from
// the start again past its end), or seeded uniform pixels and labels.
struct Examples {
  Tensor inputs;  // (rows, 28, 28) f32, pixel / 255
  Tensor labels;  // (rows) i64
};

Examples take_examples(const mb::train::FashionMNIST* data, std::int64_t rows, std::uint64_t seed) {
  std::vector<double> pixels(static_cast<std::size_t>(rows * kPixels));
  std::vector<double> labels(static_cast<std::size_t>(rows));
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> byte(0, 255), label(0, 9);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = data != nullptr ? r % data->size() : r;
    const std::uint8_t* src = data != nullptr ? data->pixels(i) : nullptr;
    for (std::int64_t p = 0; p < kPixels; ++p) {
      const int value = src != nullptr ? src[p] : byte(gen);
      pixels[static_cast<std::size_t>(r * kPixels + p)] = static_cast<float>(value) / 255.0f;
    }
    labels[static_cast<std::size_t>(r)] =
        static_cast<double>(data != nullptr ? data->label(i) : label(gen));
  }
  return {mb::from_vector(pixels, {rows, kSide, kSide}),
          mb::from_vector(labels, {rows}, {.dtype = DType::i64})};
}

struct Run {
  std::int64_t batch = 0;
  std::string error;  // why the run stopped; a failed run records nothing else
  mb::bench::Timing step;
  std::vector<double> losses;  // every step's loss, warm-up included
  std::vector<double> grad_norms;
  std::int64_t peak_allocated = 0, peak_reserved = 0;
  mb::bench::ResidentGrowth rss;  // on the CPU, where Linux gives the figures
};

double samples_per_s(const Run& r) {
  return static_cast<double>(r.batch) / (r.step.median_ms * 1e-3);
}

nlohmann::json run_json(const Run& r) {
  if (!r.error.empty()) return {{"batch", r.batch}, {"error", r.error}};
  nlohmann::json j = {{"batch", r.batch},
                      {"step_ms_median", r.step.median_ms},
                      {"step_ms_min", r.step.min_ms},
                      {"step_ms_max", r.step.max_ms},
                      {"steps_timed", r.step.reps},
                      {"samples_per_s", samples_per_s(r)},
                      {"peak_allocated_bytes", r.peak_allocated},
                      {"peak_reserved_bytes", r.peak_reserved},
                      {"losses", r.losses},
                      {"grad_norms", r.grad_norms}};
  r.rss.add_to(j);
  return j;
}

// Trains a model of its own from `initial` for warmup + steps optimizer steps of B examples each.
Run train_batch(const std::string& model_name, const mb::nn::StateDict& initial, const Examples& ex,
                std::int64_t B, int warmup, int steps, mb::Device dev) {
  Run run{.batch = B};
  mb::empty_cache(dev);
  mb::bench::release_free_heap();
  const mb::bench::ResidentMemory before = mb::bench::resident_memory();
  std::shared_ptr<mb::nn::Model> model = make_model(model_name);
  model->load_state_dict(initial);
  model->to(dev);
  mb::optim::ParamStore store(*model, {.compute_dtype = DType::f32});
  mb::reset_peak_memory_stats(dev);
  mb::optim::AdamW adamw(store, {.lr = 1e-3, .weight_decay = 0.01});
  mb::optim::LRScheduler schedule(adamw, {.type = mb::optim::ScheduleType::Constant});
  mb::optim::BoundaryStep boundary(store, adamw, schedule, nullptr, {.max_grad_norm = 1.0});
  const Tensor inputs = ex.inputs.to(dev), labels = ex.labels.to(dev);

  mb::bench::RepTimer timer(dev);
  std::vector<std::pair<int, int>> marks;
  std::vector<Tensor> losses;
  // The peak counts from here, as in bench_gpt2_cuda: the store's transient second copy of the
  // weights is not training's.
  const bool rss_peak_reset = !dev.is_cuda() && mb::bench::reset_resident_peak();
  for (int i = 0; i < warmup + steps; ++i) {
    const int a = timer.mark();
    store.zero_grad();
    Tensor loss =
        (*model)(inputs.slice(0, i * B, (i + 1) * B), labels.slice(0, i * B, (i + 1) * B)).loss;
    loss.backward();
    for (const mb::optim::StepOutcome& o : boundary.step(i + 1, mb::optim::Settle::Later))
      run.grad_norms.push_back(o.grad_norm);
    marks.emplace_back(a, timer.mark());
    losses.push_back(loss.detach());
  }
  for (const mb::optim::StepOutcome& o : boundary.settle()) run.grad_norms.push_back(o.grad_norm);
  std::vector<double> ms;
  for (std::size_t i = 0; i < marks.size(); ++i) {
    const double ms_step = timer.ms(marks[i].first, marks[i].second);
    const bool warm_up = i < static_cast<std::size_t>(warmup);
    if (!warm_up) ms.push_back(ms_step);
    run.losses.push_back(losses[i].item());
    std::printf("  B=%lld step %2zu: loss %.4f, grad norm %.3f, %.2f ms%s\n",
                static_cast<long long>(B), i, run.losses.back(),
                i < run.grad_norms.size() ? run.grad_norms[i] : std::nan(""), ms_step,
                warm_up ? " (warm-up)" : "");
  }
  run.step = mb::bench::summarize(ms);
  const mb::MemoryStats stats = mb::memory_stats(dev);
  run.peak_allocated = stats.allocated.peak;
  run.peak_reserved = stats.reserved.peak;
  run.rss = mb::bench::resident_growth(before, rss_peak_reset);
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  mb::bench::Args args(argc, argv);
  const std::string json_path = args.get("--json", "");
  const std::string out_dir = args.get("--out-dir", ".");
  const std::string model_name = args.get("--model", "mlp");
  const std::string data_arg = args.get("--data", mb::train::kFashionMnistRoot);
  const std::string device_arg = args.get("--device", "cpu");
  std::vector<std::int64_t> batches;
  int steps = 0, warmup = 0;
  mb::Device dev = mb::kCPU;
  try {
    batches = mb::bench::parse_sizes(args.get("--batch", "64,256"), "bench_image_cuda");
    steps = static_cast<int>(args.get_int("--steps", 30));
    warmup = static_cast<int>(args.get_int("--warmup", 3));
    dev = mb::parse_device(device_arg);
    (void)make_model(model_name);
  } catch (const std::logic_error& e) {  // std::stoll's; its message names only itself
    std::fprintf(stderr,
                 "bench_image_cuda: --batch, --steps and --warmup take whole numbers (%s)\n%s",
                 e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_image_cuda: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (steps < 1 || warmup < 0) {
    std::fprintf(stderr, "bench_image_cuda: --steps must be >= 1 and --warmup >= 0\n");
    return 2;
  }
  if (!args.unknown().empty()) {
    std::fprintf(stderr, "bench_image_cuda: unknown argument '%s'\n%s", args.unknown().c_str(),
                 kUsage);
    return 2;
  }
  if (dev.is_cuda() && !mb::cuda_available()) {
    std::fprintf(stderr, "bench_image_cuda: no CUDA device here (--device cpu runs on the CPU)\n");
    return 2;
  }

  nlohmann::json report = {{"benchmark", "image"},
                           {"implementation", "microbatch"},
                           {"device", device_arg},
                           {"model", model_name},
                           {"precision", "f32 weights, activations and gradients"},
                           {"optimizer",
                            "AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on "
                            "tensors of 2+ dims; clip 1.0"},
                           {"batches", batches},
                           {"warmup", warmup},
                           {"runs", nlohmann::json::array()}};
  std::vector<Run> runs;
  bool failed = false;
  auto write_outputs = [&] {
    report["runs"] = nlohmann::json::array();
    for (const Run& r : runs) report["runs"].push_back(run_json(r));
    try {
      mb::bench::write_json(json_path, report);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_image_cuda: %s\n", e.what());
      failed = true;
    }
  };

  try {
    report["device"] = mb::bench::device_name(dev);
#if defined(_OPENMP)
    if (!dev.is_cuda()) report["threads"] = omp_get_max_threads();
#endif
    std::filesystem::create_directories(out_dir);
    const std::filesystem::path dir(out_dir);
    std::unique_ptr<mb::train::FashionMNIST> data;
    if (data_arg != "synthetic") data = std::make_unique<mb::train::FashionMNIST>(data_arg);
    report["data"] = data != nullptr ? data->images_path() : "synthetic";

    mb::manual_seed(42);
    mb::nn::StateDict initial;
    {
      const std::shared_ptr<mb::nn::Model> model = make_model(model_name);
      report["parameters"] = model->num_parameters();
      initial = model->state_dict();
    }
    const std::string weights_path = (dir / ("image_" + model_name + "_init.safetensors")).string();
    mb::save_safetensors(weights_path, initial, {{"model", model_name}});
    report["weights"] = weights_path;

    mb::NamedTensorMap batch_tensors;
    std::vector<Examples> examples;
    for (std::int64_t B : batches) {
      examples.push_back(
          take_examples(data.get(), B * (warmup + steps), 1000 + static_cast<std::uint64_t>(B)));
      batch_tensors["inputs_b" + std::to_string(B)] = examples.back().inputs;
      batch_tensors["labels_b" + std::to_string(B)] = examples.back().labels;
    }
    const std::string batches_path =
        (dir / ("image_" + model_name + "_batches.safetensors")).string();
    mb::save_safetensors(batches_path, batch_tensors);
    report["batches_file"] = batches_path;
    std::printf("%s (f32): %lld parameters on %s, data %s; initial weights in %s\n",
                model_name.c_str(),
                static_cast<long long>(report["parameters"].get<std::int64_t>()),
                mb::bench::device_name(dev).c_str(), report["data"].get<std::string>().c_str(),
                weights_path.c_str());

    for (std::size_t k = 0; k < batches.size(); ++k) {
      try {
        runs.push_back(
            train_batch(model_name, initial, examples[k], batches[k], warmup, steps, dev));
      } catch (const std::exception& e) {
        runs.push_back({.batch = batches[k], .error = e.what()});
        std::fprintf(stderr, "bench_image_cuda: B=%lld failed: %s\n",
                     static_cast<long long>(batches[k]), e.what());
        failed = true;
      }
      write_outputs();
    }
  } catch (const std::exception& e) {
    report["error"] = e.what();
    std::fprintf(stderr, "bench_image_cuda: %s\n", e.what());
    failed = true;
  }

  if (!runs.empty())
    std::printf("\n%6s %10s %12s %14s %14s %10s\n", "batch", "step ms", "samples/s", "peak alloc",
                "RSS growth", "last loss");
  for (const Run& r : runs) {
    if (!r.error.empty()) {
      std::printf("%6lld   failed: %s\n", static_cast<long long>(r.batch), r.error.c_str());
      continue;
    }
    std::printf("%6lld %10.2f %12.0f %14s %14s %10.4f\n", static_cast<long long>(r.batch),
                r.step.median_ms, samples_per_s(r), mb::format_bytes(r.peak_allocated).c_str(),
                r.rss.text().c_str(), r.losses.back());
  }
  write_outputs();
  return failed ? 1 : 0;
}
