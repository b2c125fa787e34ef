// Data-parallel training across the processes `mpirun -np 2` starts (ctest's data_parallel
// entry): every case runs on both ranks, in step, and compares what the two trained together with
// what one process trains alone (ProcessGroup::solo()) on the same data and windows. Sums over
// the ranks are taken in another order than one process's sums, so weights agree to rounding;
// the ranks themselves must agree to the bit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>

#include "core/safetensors.h"
#include "optim/optimizer.h"
#include "optim/param_store.h"
#include "tests/core/harness.h"
#include "tests/train/trainer_fixtures.h"
#include "train/accelerator.h"
#include "train/distributed.h"
#include "train/trainer.h"

using namespace microbatch;
using namespace microbatch::testing;
using namespace microbatch::train;
namespace fs = std::filesystem;

namespace {

ProcessGroup& world() { return ProcessGroup::world(); }

// A folder both ranks use: rank 0 makes it and sends its name to rank 1. Removed at scope exit,
// once both are done with it.
struct SharedDir {
  SharedDir() {
    std::string name;
    if (world().is_main()) {
      name = (fs::temp_directory_path() / "mb_dp_XXXXXX").string();
      REQUIRE(mkdtemp(name.data()) != nullptr);
    }
    world().broadcast(name, 0);
    path = name;
  }
  ~SharedDir() {
    world().barrier();
    if (world().is_main()) fs::remove_all(path);
  }
  fs::path path;
};

// The largest difference between two models' parameters of the same names.
double max_difference(const nn::StateDict& a, const nn::StateDict& b) {
  double worst = 0.0;
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    const Tensor d = max(abs(t.to(DType::f64) - b.at(name).to(DType::f64)));
    worst = std::max(worst, d.item());
  }
  return worst;
}

// Whether every rank's parameters are rank 0's, to the bit.
bool same_on_every_rank(const nn::StateDict& params) {
  std::int64_t differ = 0;
  for (const auto& [name, t] : params) {
    Tensor mine = t.contiguous().clone();
    Tensor theirs = mine.clone();
    world().broadcast(theirs);
    differ += std::memcmp(mine.raw_data(), theirs.raw_data(), mine.nbytes()) != 0;
  }
  return world().all_reduce_max(differ) == 0;
}

TrainOutput run(const TrainingArguments& args, const Dataset& data, ProcessGroup* group,
                nn::StateDict* weights, const Dataset* eval = nullptr) {
  std::ostringstream sink;
  Trainer trainer(small_mlp(), args, data, eval, {}, group);
  trainer.set_log_stream(&sink);
  TrainOutput out = trainer.train();
  if (weights) *weights = trainer.model().state_dict();
  return out;
}

}  // namespace

TEST_CASE("data parallel: the world is the launcher's two processes") {
  REQUIRE(world().size() == 2);
  CHECK(world().local_rank() == world().rank());
  CHECK(mpi_built());
}

TEST_CASE("data parallel: sums and broadcasts over MPI") {
  const double r = world().rank();
  Tensor f32 = from_vector({1.0 + r, 10.0 * (1.0 + r), -r}, {3});
  world().all_reduce_sum(f32);
  check_close(f32, {3.0, 30.0, -1.0}, 0, 0);
  Tensor f64 = from_vector({0.5 + r}, {1}, {.dtype = DType::f64});
  world().all_reduce_sum(f64);
  check_close(f64, {2.0}, 0, 0);
  Tensor i64 = from_vector({std::ldexp(1.0, 40) + r}, {1}, {.dtype = DType::i64});
  world().all_reduce_sum(i64);
  CHECK(i64.data<std::int64_t>()[0] == (std::int64_t{1} << 41) + 1);
  CHECK(world().all_reduce_sum(0.25 + r) == 1.5);
  CHECK(world().all_reduce_sum(std::int64_t{3}) == 6);
  CHECK(world().all_reduce_max(static_cast<std::int64_t>(5 * r)) == 5);
  const std::int64_t k = world().rank();
  CHECK(world().all_gather({k, 10 + k}) == std::vector<std::int64_t>{0, 10, 1, 11});
  Tensor bytes = from_vector({r, r + 1.0}, {2}, {.dtype = DType::u8});
  world().broadcast(bytes, 1);  // rank 1's bytes everywhere
  CHECK(bytes.data<std::uint8_t>()[0] == 1);
  CHECK(bytes.data<std::uint8_t>()[1] == 2);
  // 16-bit tensors are summed in f32 and rounded to their dtype: 128 + 129 is 256 in bf16 (257
  // is halfway to 258, and rounds to the even 256).
  Tensor halves = from_vector({1.5 + r, -2.0 * r, 0.25}, {3}, {.dtype = DType::f16});
  world().all_reduce_sum(halves);
  check_close(halves.to(DType::f32), {4.0, -2.0, 0.5}, 0, 0);
  Tensor bfs = from_vector({1.0 + r, 128.0 + r, -0.5}, {3}, {.dtype = DType::bf16});
  world().all_reduce_sum(bfs);
  check_close(bfs.to(DType::f32), {3.0, 256.0, -1.0}, 0, 0);
  Tensor bools = zeros({4}, {.dtype = DType::u8});
  check_throws_with([&] { world().all_reduce_sum(bools); }, "MPI cannot sum u8 tensors");
}

TEST_CASE("data parallel: the Trainer's ranks take one process's full-window steps") {
  // 65 examples in windows of 16: four whole windows and one of a single example, which leaves
  // rank 1 without a sample in it (it only sums). Two epochs, logged and clipped every step.
  TensorDataset data = synthetic_images(65, 11);
  SharedDir dir;
  TrainingArguments parallel = small_run(dir.path / "parallel");
  parallel.per_device_train_batch_size = 4;  // x 2 accumulation steps x 2 processes = 16
  parallel.max_grad_norm = 0.5;
  nn::StateDict together;
  const TrainOutput a = run(parallel, data, nullptr, &together);

  TrainingArguments alone = small_run(dir.path / fmt::format("alone-{}", world().rank()));
  alone.per_device_train_batch_size = 8;  // x 2 accumulation steps = 16, in one process
  alone.max_grad_norm = 0.5;
  nn::StateDict single;
  const TrainOutput b = run(alone, data, &ProcessGroup::solo(), &single);

  CHECK(a.global_step == 10);
  CHECK(a.global_step == b.global_step);
  CHECK(std::abs(a.training_loss - b.training_loss) < 1e-6);
  const double diff = max_difference(together, single);
  INFO("largest parameter difference from one process: " << diff);
  CHECK(diff < 1e-6);
  CHECK(same_on_every_rank(together));

  // Rank 0 alone wrote the log; it counts every rank's samples.
  if (world().is_main()) {
    std::ifstream log(dir.path / "parallel" / "log.jsonl");
    std::string line, last;
    int steps = 0;
    while (std::getline(log, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("loss") && !j.contains("event")) {
        ++steps;
        last = line;
      }
    }
    CHECK(steps == 10);
    CHECK(nlohmann::json::parse(last).at("samples") == 130);
    CHECK(fs::exists(dir.path / "parallel" / "model.safetensors"));
  }
}

TEST_CASE("data parallel: token sequences of different lengths weigh by the window's tokens") {
  // Padded labels carry no loss, so the ranks' shares of a window hold different numbers of tokens:
  // each micro-batch must be weighed by its share of the whole window's tokens, not of its rank's.
  // In f64 the sum's other order leaves only the last bits.
  std::vector<std::int64_t> lengths;
  for (int i = 0; i < 40; ++i) lengths.push_back(2 + (i * 7) % 15);
  Sequences data(lengths, 13);
  SharedDir dir;
  auto train_gpt = [&](TrainingArguments args, ProcessGroup* group) {
    std::ostringstream sink;
    Trainer trainer(f64_gpt(13), args, data, nullptr, {}, group);
    trainer.set_log_stream(&sink);
    const TrainOutput out = trainer.train();
    return std::make_pair(out, trainer.model().state_dict());
  };
  TrainingArguments parallel = small_run(dir.path / "parallel");
  parallel.per_device_train_batch_size = 3;  // x 2 x 2 processes = windows of 12
  TrainingArguments alone = small_run(dir.path / fmt::format("alone-{}", world().rank()));
  alone.per_device_train_batch_size = 6;
  const auto [a, together] = train_gpt(parallel, nullptr);
  const auto [b, single] = train_gpt(alone, &ProcessGroup::solo());
  CHECK(a.global_step == 8);
  CHECK(std::abs(a.training_loss - b.training_loss) < 1e-12);
  const double diff = max_difference(together, single);
  INFO("largest parameter difference from one process: " << diff);
  CHECK(diff < 1e-12);
  CHECK(same_on_every_rank(together));
}

TEST_CASE("data parallel: the ranks plan every rank's shares of the windows against the budget") {
  // Sequences of 4 and 16 tokens, packed by tokens under a budget that fits 4 short sequences:
  // the ranks make one plan for their shares of the effective batch (it replays every rank's
  // shares of the windows: Note [Agreed plans]), no micro-batch runs out of memory on either rank,
  // and the weights are one process's without a budget. (The micro-batch is the same had each rank
  // replayed only its own windows: planned at the longest sequence, it does not tell them apart.)
  std::vector<std::int64_t> lengths(48, 4);
  for (int i = 5; i < 48; i += 3) lengths[i] = 16;
  Sequences data(lengths, 13);
  std::vector<std::int64_t> short_lengths(4, 4);
  Sequences short_data(short_lengths, 13);
  const std::int64_t budget = budget_for_window(f64_gpt(13), short_data, 4);
  SharedDir dir;
  auto train_gpt = [&](TrainingArguments args, ProcessGroup* group) {
    std::ostringstream sink;
    empty_cache(kCPU);
    Trainer trainer(f64_gpt(13), args, data, nullptr, {}, group);
    trainer.set_log_stream(&sink);
    if (group == nullptr) {  // the ranks' plans are one
      const std::vector<std::int64_t> plans =
          world().all_gather({trainer.plan().micro_batch_size, trainer.plan().predicted_peak});
      CHECK(plans[0] == plans[2]);
      CHECK(plans[1] == plans[3]);
    }
    const TrainOutput out = trainer.train();
    clear_memory_budget(kCPU);
    return std::make_pair(out, trainer.model().state_dict());
  };
  TrainingArguments parallel = small_run(dir.path / "parallel");
  parallel.per_device_train_batch_size = kAutoBatch;
  parallel.gradient_accumulation_steps = 1;
  parallel.train_batch_size = 16;  // 8 a rank
  parallel.memory_budget = budget;
  const auto [a, together] = train_gpt(parallel, nullptr);
  CHECK(a.oom_splits == 0);
  CHECK(world().all_reduce_sum(a.oom_splits) == 0);
  TrainingArguments alone = small_run(dir.path / fmt::format("alone-{}", world().rank()));
  alone.per_device_train_batch_size = 16;
  alone.gradient_accumulation_steps = 1;
  const auto [b, single] = train_gpt(alone, &ProcessGroup::solo());
  CHECK(max_difference(together, single) < 1e-12);
}

TEST_CASE("data parallel: the predicted peak of many lengths is the highest rank's measured one") {
  // Note [Mixed lengths]: sequences of many lengths leave the cache holding blocks for the shapes
  // a run meets, in the order it meets them, and each rank meets its own. The plan replays every
  // rank's shares of the windows (Note [Agreed plans]), so its predicted peak is the highest of the
  // ranks' peaks, which the log's measured_peak is, to within 0.5% (measured: to the byte, as one
  // process's in test_trainer_budget.cpp). Replaying rank 0's shares alone, the prediction was
  // 1.4% under it (488,960 bytes against 496,128).
  std::mt19937_64 draw(11);
  std::vector<std::int64_t> lengths;
  for (int i = 0; i < 96; ++i) lengths.push_back(3 + static_cast<std::int64_t>(draw() % 14));
  Sequences data(lengths, 13);
  SharedDir dir;
  TrainingArguments args = small_run(dir.path / "parallel");
  args.per_device_train_batch_size = 2;  // x 4 x 2 processes = windows of 16
  args.gradient_accumulation_steps = 4;
  args.num_train_epochs = 20;
  args.memory_budget = 64 << 20;  // far above any of these peaks
  std::ostringstream sink;
  empty_cache(kCPU);
  Trainer trainer(f64_gpt(13), args, data);
  trainer.set_log_stream(&sink);
  trainer.train();
  clear_memory_budget(kCPU);
  world().barrier();  // rank 0's log is whole
  std::int64_t peak = 0;
  for (auto& l : read_log(dir.path / "parallel"))
    if (!l.contains("event")) peak = std::max(peak, l["measured_peak"].get<std::int64_t>());
  const std::int64_t predicted = trainer.plan().predicted_peak;
  INFO("predicted " << predicted << ", measured " << peak);
  CHECK(peak > 0);
  CHECK(std::abs(static_cast<double>(peak - predicted)) <= 0.005 * static_cast<double>(predicted));
}

TEST_CASE("data parallel: bf16 gradient accumulators are summed over MPI") {
  // bf16 weights and bf16 accumulators: each rank's share of a window is summed in bf16, the ranks'
  // sums are added in f32 and rounded once. One process rounds after every micro-batch instead, so
  // the runs differ by bf16 rounding; the ranks agree to the bit. The calibration: one process
  // trained on windows of 8, as a rank would alone without the sum.
  TensorDataset data = synthetic_images(64, 20);
  SharedDir dir;
  TrainingArguments parallel = small_run(dir.path / "parallel");
  parallel.per_device_train_batch_size = 4;
  parallel.bf16 = true;
  parallel.gradient_accumulation_dtype = "bf16";
  nn::StateDict together, single;
  run(parallel, data, nullptr, &together);
  CHECK(same_on_every_rank(together));
  TrainingArguments alone = small_run(dir.path / fmt::format("alone-{}", world().rank()));
  alone.per_device_train_batch_size = 8;
  alone.bf16 = true;
  alone.gradient_accumulation_dtype = "bf16";
  run(alone, data, &ProcessGroup::solo(), &single);
  TrainingArguments half = alone;
  half.output_dir = (dir.path / fmt::format("half-{}", world().rank())).string();
  half.per_device_train_batch_size = 4;
  nn::StateDict halved;
  run(half, data, &ProcessGroup::solo(), &halved);
  auto mean_difference = [](const nn::StateDict& x, const nn::StateDict& y) {
    double sum = 0.0, n = 0.0;
    for (const auto& [name, t] : x) {
      sum += microbatch::sum(abs(t.to(DType::f64) - y.at(name).to(DType::f64))).item();
      n += static_cast<double>(t.numel());
    }
    return sum / n;
  };
  INFO("from one process: " << max_difference(together, single) << " mean "
                            << mean_difference(together, single)
                            << "; one process with windows of 8: " << max_difference(halved, single)
                            << " mean " << mean_difference(halved, single));
  // Rounding moves a few weights by an ulp or two (the largest differences are alike), a missing
  // half of the sum moves most of them: measured 1.1e-5 against 1.3e-3 on average.
  CHECK(mean_difference(together, single) < 1e-4);
  CHECK(mean_difference(halved, single) > 5e-4);
}

TEST_CASE("data parallel: under fp16 an overflow on one rank skips the step on every rank") {
  // One poisoned image: the window holding it overflows on the rank that reads it, and after the
  // sum on both, so both skip its step (the scale backs off on both) as one process does.
  manual_seed(21);
  Tensor x = rand({64, 28, 28});
  {
    NoGradGuard no_grad;
    x.select(0, 5).fill_(std::numeric_limits<double>::infinity());
  }
  TensorDataset data(x, (rand({64}) * 10.0).to(DType::i64));
  SharedDir dir;
  TrainingArguments parallel = small_run(dir.path / "parallel");
  parallel.per_device_train_batch_size = 4;
  parallel.fp16 = true;
  nn::StateDict together, single;
  const TrainOutput a = run(parallel, data, nullptr, &together);
  TrainingArguments alone = small_run(dir.path / fmt::format("alone-{}", world().rank()));
  alone.per_device_train_batch_size = 8;
  alone.fp16 = true;
  const TrainOutput b = run(alone, data, &ProcessGroup::solo(), &single);
  CHECK(a.skipped_steps == 2);  // the poisoned window of each epoch
  CHECK(a.skipped_steps == b.skipped_steps);
  CHECK(world().all_reduce_max(a.skipped_steps) == world().all_reduce_sum(a.skipped_steps) / 2);
  CHECK(max_difference(together, single) <
        1e-3);  // f16 working weights: one rounding apart at most
  CHECK(same_on_every_rank(together));
}

TEST_CASE("data parallel: the tolerance above tells a missing sum apart") {
  // Calibration, in one process: training on half of each window, as a rank whose sum with the
  // other's went missing would, moves the weights far past the cases' tolerance of 1e-6.
  TensorDataset data = synthetic_images(64, 11);
  SharedDir dir;
  TrainingArguments alone = small_run(dir.path / fmt::format("share-{}", world().rank()));
  alone.per_device_train_batch_size = 8;
  nn::StateDict single, share;
  run(alone, data, &ProcessGroup::solo(), &single);
  alone.output_dir = (dir.path / fmt::format("half-{}", world().rank())).string();
  alone.per_device_train_batch_size = 4;  // half of each window, one process
  run(alone, data, &ProcessGroup::solo(), &share);
  CHECK(max_difference(single, share) > 1e-3);
}

TEST_CASE("data parallel: evaluation sums the ranks' shares; metrics see the whole set") {
  TensorDataset data = synthetic_images(32, 12), eval = synthetic_images(37, 13);
  SharedDir dir;
  TrainingArguments args = small_run(dir.path / "parallel");
  args.per_device_train_batch_size = 4;
  Trainer together(small_mlp(), args, data, &eval);
  const Metrics shared = together.evaluate();
  args.output_dir = (dir.path / fmt::format("alone-{}", world().rank())).string();
  args.per_device_train_batch_size = 8;
  Trainer alone(small_mlp(), args, data, &eval, {}, &ProcessGroup::solo());
  const Metrics whole = alone.evaluate();
  CHECK(std::abs(shared.at("eval_loss") - whole.at("eval_loss")) < 1e-6);

  // With compute_metrics each rank predicts the whole set: the metrics are one process's.
  args.output_dir = (dir.path / "parallel").string();
  args.per_device_train_batch_size = 4;
  Trainer with_metrics(small_mlp(), args, data, &eval, classification_metrics);
  args.output_dir = (dir.path / fmt::format("alone-{}", world().rank())).string();
  args.per_device_train_batch_size = 8;
  Trainer alone_metrics(small_mlp(), args, data, &eval, classification_metrics,
                        &ProcessGroup::solo());
  const Metrics m = with_metrics.evaluate(), reference = alone_metrics.evaluate();
  CHECK(m.at("eval_accuracy") == reference.at("eval_accuracy"));
  CHECK(std::abs(m.at("eval_loss") - reference.at("eval_loss")) < 1e-6);
  // Each rank predicts its share; the rows gathered are the whole set's, in its order (Note
  // [Sharded predictions]), and each example is predicted once: 37 rows, as one process's.
  const PredictionOutput gathered = with_metrics.predict(eval), one = alone_metrics.predict(eval);
  REQUIRE(gathered.predictions.shape() == one.predictions.shape());
  CHECK(gathered.predictions.size(0) == 37);
  check_close(gathered.predictions, one.predictions, 1e-6, 1e-6);
  check_close(gathered.label_ids, one.label_ids, 0, 0);
}

TEST_CASE("data parallel: predictions of sequences of different lengths gather in order") {
  // 11 sequences of 2 to 12 tokens, 6 on rank 0 and 5 on rank 1, each rank's batches padded to
  // their own longest: gathered, they are padded to the set's longest, as one process pads them.
  // Past a row's own tokens its logits are the padding's (the model's outputs on padded tokens,
  // or -100 where its batch was shorter), which depend on the batch it was in: the labels there
  // are ignore_index, and the logits are compared where the labels are not.
  std::vector<std::int64_t> lengths{5, 2, 12, 7, 3, 9, 4, 11, 6, 8, 10};
  Sequences data(lengths, 13);
  SharedDir dir;
  auto predict_with = [&](ProcessGroup* group, const std::string& name) {
    TrainingArguments args = small_run(dir.path / name);
    args.per_device_train_batch_size = 2;
    args.per_device_eval_batch_size = 3;
    Trainer trainer(f64_gpt(13), args, data, nullptr, {}, group);
    return trainer.predict(data);
  };
  const PredictionOutput gathered = predict_with(nullptr, "parallel");
  const PredictionOutput one =
      predict_with(&ProcessGroup::solo(), fmt::format("alone-{}", world().rank()));
  REQUIRE(gathered.predictions.shape() == one.predictions.shape());
  CHECK(gathered.predictions.size(1) == 12);
  check_close(gathered.label_ids, one.label_ids, 0, 0);
  const Tensor labels = one.label_ids.contiguous(), a = gathered.predictions.contiguous(),
               b = one.predictions.contiguous();
  const std::int64_t vocab = a.size(2);
  double worst = 0.0;
  std::int64_t compared = 0;
  for (std::int64_t i = 0; i < labels.numel(); ++i) {
    if (labels.data<std::int64_t>()[i] == -100) continue;
    for (std::int64_t v = 0; v < vocab; ++v) {
      worst = std::max(worst,
                       std::abs(a.data<double>()[i * vocab + v] - b.data<double>()[i * vocab + v]));
    }
    ++compared;
  }
  CHECK(compared == 77);  // 2 + 3 + ... + 12 tokens
  CHECK(worst < 1e-12);
  CHECK(std::abs(gathered.metrics.at("test_loss") - one.metrics.at("test_loss")) < 1e-12);
}

TEST_CASE("data parallel: a checkpoint of two ranks resumes in one process") {
  TensorDataset data = synthetic_images(64, 14);
  SharedDir dir;
  TrainingArguments parallel = small_run(dir.path / "parallel");
  parallel.per_device_train_batch_size = 4;
  parallel.max_steps = 6;
  parallel.save_strategy = "steps";
  parallel.save_steps = 3;
  nn::StateDict together;
  run(parallel, data, nullptr, &together);
  const fs::path checkpoint = dir.path / "parallel" / "checkpoint-3";
  REQUIRE(fs::exists(checkpoint));
  TrainingArguments alone = small_run(dir.path / fmt::format("alone-{}", world().rank()));
  alone.per_device_train_batch_size = 8;
  alone.max_steps = 6;
  alone.resume_from_checkpoint = checkpoint.string();
  nn::StateDict resumed;
  const TrainOutput r = run(alone, data, &ProcessGroup::solo(), &resumed);
  CHECK(r.global_step == 6);
  CHECK(max_difference(together, resumed) < 1e-6);

  // Resumed in two processes, the run is the uninterrupted one to the bit.
  TrainingArguments again = parallel;
  again.output_dir = (dir.path / "again").string();
  again.resume_from_checkpoint = checkpoint.string();
  nn::StateDict twice;
  run(again, data, nullptr, &twice);
  CHECK(max_difference(together, twice) == 0.0);
  // And from "latest", which rank 0 finds for every rank, to plan and to load.
  if (world().is_main()) {
    fs::create_directories(dir.path / "latest");
    fs::copy(checkpoint, dir.path / "latest" / "checkpoint-3", fs::copy_options::recursive);
  }
  world().barrier();
  again.output_dir = (dir.path / "latest").string();
  again.resume_from_checkpoint = "latest";
  nn::StateDict latest;
  const TrainOutput from_latest = run(again, data, nullptr, &latest);
  CHECK(from_latest.global_step == 6);
  CHECK(max_difference(together, latest) == 0.0);

  // Another effective batch would read other windows: refused, counting every rank's share.
  alone.per_device_train_batch_size = 4;
  alone.output_dir = (dir.path / fmt::format("other-{}", world().rank())).string();
  check_throws_with([&] { run(alone, data, &ProcessGroup::solo(), nullptr); },
                    "trained with an effective batch of 16, this run has 8");
}

TEST_CASE("data parallel: with dropout a resumed run draws each rank's own stream") {
  // 65 examples: the last window of each epoch is one sample, rank 0's, so after an epoch the
  // ranks' random streams have drawn different amounts. A checkpoint holds each rank's stream, and
  // the run resumed in two processes is the uninterrupted one to the bit.
  TensorDataset data = synthetic_images(65, 17);
  SharedDir dir;
  auto train_dropout = [&](const TrainingArguments& args) {
    std::ostringstream sink;
    Trainer trainer(
        [] {
          return std::make_unique<nn::MLP>(nn::MLPConfig{.hidden = {64, 32}, .dropout = 0.3});
        },
        args, data);
    trainer.set_log_stream(&sink);
    trainer.train();
    return trainer.model().state_dict();
  };
  TrainingArguments args = small_run(dir.path / "parallel");
  args.per_device_train_batch_size = 4;
  args.save_strategy = "steps";
  args.save_steps = 5;  // an epoch's end
  const nn::StateDict whole = train_dropout(args);
  if (world().is_main()) {
    std::ifstream in(dir.path / "parallel" / "checkpoint-5" / "trainer_state.json");
    std::stringstream text;
    text << in.rdbuf();
    const nlohmann::json streams = nlohmann::json::parse(text.str()).at("rng_ranks");
    REQUIRE(streams.size() == 2);
    CHECK(streams[0] != streams[1]);  // what the case is about
  }
  args.output_dir = (dir.path / "resumed").string();
  args.resume_from_checkpoint = (dir.path / "parallel" / "checkpoint-5").string();
  const nn::StateDict resumed = train_dropout(args);
  CHECK(max_difference(whole, resumed) == 0.0);
}

TEST_CASE("data parallel: an effective batch that does not split evenly is refused on every rank") {
  TensorDataset data = synthetic_images(32, 15);
  SharedDir dir;
  TrainingArguments args = small_run(dir.path / "parallel");
  args.per_device_train_batch_size = 5;
  args.gradient_accumulation_steps = 3;
  args.train_batch_size = 15;
  check_throws_with([&] { run(args, data, nullptr, nullptr); },
                    "train_batch_size 15 is not divisible by the 2 processes");
}

// A dataset that, on one rank, fails to read its examples once armed (a file gone bad mid-run).
class FailingOnRank : public Dataset {
 public:
  FailingOnRank(const Dataset& base, int rank) : base_(base), rank_(rank) {}
  std::int64_t size() const override { return base_.size(); }
  Example get(std::int64_t index) const override {
    if (armed && world().rank() == rank_) {
      if (out_of_memory)
        throw OutOfMemoryError(fmt::format("example {} is too large", index), 12345);
      MB_CHECK(false, "example {} is corrupt", index);
    }
    return base_.get(index);
  }
  bool armed = false;
  bool out_of_memory = false;  // fail with an OutOfMemoryError

 private:
  const Dataset& base_;
  int rank_;
};

TEST_CASE("data parallel: an error on one rank stops every rank with its message") {
  // Note [Failing together]: without it, the rank that did not fail waits in the next sum for
  // ever (ctest's time-out ends this case as a failure).
  TensorDataset base = synthetic_images(32, 16);
  SharedDir dir;
  for (int failing : {0, 1}) {
    CAPTURE(failing);
    FailingOnRank data(base, failing);
    TrainingArguments args = small_run(dir.path / fmt::format("examples-{}", failing));
    args.per_device_train_batch_size = 4;
    std::ostringstream sink;
    Trainer trainer(small_mlp(), args, data, nullptr, {}, nullptr);
    trainer.set_log_stream(&sink);
    trainer.set_step_callback([&](std::int64_t step) { data.armed = step == 2; });
    const std::string expected =
        world().rank() == failing
            ? std::string("is corrupt")
            : fmt::format("rank {} of 2 failed while training step 3: example ", failing);
    check_throws_with([&] { trainer.train(); }, expected);
  }
  // Every rank throws one kind, a SharedFailure that names the failing rank: an OutOfMemoryError
  // when that rank ran out of memory, so that a program retrying on one retries on every rank.
  FailingOnRank data(base, 1);
  data.out_of_memory = true;
  TrainingArguments args = small_run(dir.path / "out-of-memory");
  args.per_device_train_batch_size = 4;
  std::ostringstream sink;
  Trainer trainer(small_mlp(), args, data, nullptr, {}, nullptr);
  trainer.set_log_stream(&sink);
  trainer.set_step_callback([&](std::int64_t step) { data.armed = step == 1; });
  try {
    trainer.train();
    FAIL("no error");
  } catch (const SharedOutOfMemoryError& e) {
    CHECK(e.failed_rank() == 1);
    CHECK(e.requested() == 12345);
    CHECK(std::string(e.what()).find(world().rank() == 1 ? "example" : "rank 1 of 2 failed") !=
          std::string::npos);
  }
  // A step callback that throws on rank 0 alone.
  TrainingArguments callback_args = small_run(dir.path / "callback");
  callback_args.per_device_train_batch_size = 4;
  Trainer with_callback(small_mlp(), callback_args, base, nullptr, {}, nullptr);
  with_callback.set_log_stream(&sink);
  with_callback.set_step_callback([&](std::int64_t step) {
    MB_CHECK(!(step == 2 && world().is_main()), "the callback stops at step {}", step);
  });
  try {
    with_callback.train();
    FAIL("no error");
  } catch (const SharedError& e) {
    CHECK(e.failed_rank() == 0);
    CHECK(std::string(e.what()).find("the callback stops at step 2") != std::string::npos);
  }
  // Every rank throwing at once keeps its own exception, of its own type, as one process does:
  // a callback's own way to stop early.
  struct Stop {};
  Trainer stopping(small_mlp(), callback_args, base, nullptr, {}, nullptr);
  stopping.set_log_stream(&sink);
  stopping.set_step_callback([](std::int64_t step) {
    if (step == 2) throw Stop{};
  });
  CHECK_THROWS_AS(stopping.train(), Stop);
  // A callback on rank 0 alone (to log from one rank): the run goes on on both.
  std::int64_t seen = 0;
  Trainer logging(small_mlp(), callback_args, base, nullptr, {}, nullptr);
  logging.set_log_stream(&sink);
  if (world().is_main()) logging.set_step_callback([&](std::int64_t) { ++seen; });
  const TrainOutput out = logging.train();
  CHECK(seen == (world().is_main() ? out.global_step : 0));
  // The world is still whole: the ranks go on summing together.
  CHECK(world().all_reduce_sum(std::int64_t{1}) == 2);
}

TEST_CASE(
    "data parallel: a log, checkpoint or evaluation that fails on one rank stops every rank") {
  TensorDataset data = synthetic_images(32, 17), eval = synthetic_images(12, 18);
  SharedDir dir;
  // Rank 0 alone writes the log: a folder in its place stops it, and rank 1 with it.
  TrainingArguments args = small_run(dir.path / "log");
  args.per_device_train_batch_size = 4;
  if (world().is_main()) fs::create_directories(dir.path / "log" / "log.jsonl");
  world().barrier();
  check_throws_with([&] { run(args, data, nullptr, nullptr); },
                    world().is_main() ? "cannot write"
                                      : "rank 0 of 2 failed while opening output_dir: [Trainer] "
                                        "cannot write");
  // A checkpoint that rank 0 cannot write: a file where its folder's parent should be.
  args.output_dir = (dir.path / "save").string();
  args.save_strategy = "steps";
  args.save_steps = 2;
  std::ostringstream sink;
  Trainer saving(small_mlp(), args, data, nullptr, {}, nullptr);
  saving.set_log_stream(&sink);
  saving.set_step_callback([&](std::int64_t step) {
    if (step == 1 && world().is_main()) {
      fs::remove_all(args.output_dir);
      std::ofstream(args.output_dir) << "not a folder";
    }
  });
  check_throws_with([&] { saving.train(); }, world().is_main()
                                                 ? "checkpoint"
                                                 : "rank 0 of 2 failed while saving checkpoint-2");
  // An evaluation example that rank 1 cannot read.
  FailingOnRank bad_eval(eval, 1);
  bad_eval.armed = true;
  args = small_run(dir.path / "eval");
  args.per_device_train_batch_size = 4;
  Trainer evaluating(small_mlp(), args, data, &bad_eval, {}, nullptr);
  check_throws_with(
      [&] { evaluating.evaluate(); },
      world().is_main() ? "rank 1 of 2 failed while evaluating: example" : "is corrupt");
  CHECK(world().all_reduce_sum(std::int64_t{1}) == 2);
}

TEST_CASE("data parallel: ranks given different data, arguments or backends are refused on each") {
  TensorDataset data = synthetic_images(32, 19), fewer = synthetic_images(30, 19);
  TensorDataset relabelled = synthetic_images(32, 19);
  {
    NoGradGuard no_grad;  // one label changed: the same number of examples, other data
    relabelled.get(3).label.fill_(relabelled.get(3).label.item() < 5 ? 7.0 : 1.0);
  }
  SharedDir dir;
  TrainingArguments args = small_run(dir.path / "parallel");
  args.per_device_train_batch_size = 4;
  for (const Dataset* other :
       {static_cast<const Dataset*>(&fewer), static_cast<const Dataset*>(&relabelled)}) {
    const Dataset& mine = world().is_main() ? static_cast<const Dataset&>(data) : *other;
    check_throws_with([&] { Trainer trainer(small_mlp(), args, mine, nullptr, {}, nullptr); },
                      "differ in their data or plan (rank 0: training labels ");
  }
  // compute_metrics, or an evaluation set, on one rank alone: its evaluation would gather
  // predictions the other does not send.
  TensorDataset eval = synthetic_images(12, 20);
  check_throws_with(
      [&] {
        Trainer trainer(small_mlp(), args, data, &eval,
                        world().is_main() ? classification_metrics : ComputeMetrics(), nullptr);
      },
      "compute_metrics, micro-batches of 4, predicted peak 0 bytes; rank 1: training labels");
  {
    const Dataset* mine = world().is_main() ? &eval : nullptr;
    check_throws_with([&] { Trainer trainer(small_mlp(), args, data, mine, {}, nullptr); },
                      "12 evaluation examples, no compute_metrics");
  }
  // Arguments of one rank's own, named: a budget (the ranks would plan differently), and how often
  // to log (their collectives would go out of step).
  TrainingArguments budgeted = args, logging = args;
  if (!world().is_main()) {
    budgeted.memory_budget = 64 << 20;
    logging.logging_steps = 3;
  }
  check_throws_with([&] { Trainer trainer(small_mlp(), budgeted, data, nullptr, {}, nullptr); },
                    world().is_main() ? "rank 1 of 2 failed while comparing its arguments with "
                                        "rank 0's: [Trainer] rank 1 of 2 was given other training "
                                        "arguments than rank 0: memory_budget"
                                      : "other training arguments than rank 0: memory_budget");
  check_throws_with([&] { Trainer trainer(small_mlp(), logging, data, nullptr, {}, nullptr); },
                    "other training arguments than rank 0: logging_steps 3 (rank 0: 1)");
  // A CUDA device on rank 1 alone: refused on both ranks. Where this machine has no GPU for rank 1
  // (none, or one GPU, rank 0's), rank 1 fails and rank 0 says so; where rank 1 has one, both
  // refuse to train on different kinds of device.
  TrainingArguments device = args;
  if (!world().is_main()) {
    device.device = "cuda";
    device.use_cpu = false;
  }
  bool refused = false;
  try {
    Trainer trainer(small_mlp(), device, data, nullptr, {}, nullptr);
  } catch (const Error& e) {
    refused = true;
    const std::string what = e.what();
    INFO(what);
    CHECK((what.find(world().is_main() ? "rank 1 of 2 failed while" : "device") !=
               std::string::npos ||
           what.find("rank 1 trains on a CUDA device with ddp_backend nccl, rank 0 on the CPU") !=
               std::string::npos));
  }
  CHECK(refused);
  // ddp_backend = nccl on the CPU, on rank 1 alone: refused before any rank waits in NCCL.
  TrainingArguments backend = args;
  if (!world().is_main()) backend.ddp_backend = "nccl";
  check_throws_with([&] { Trainer trainer(small_mlp(), backend, data, nullptr, {}, nullptr); },
                    "rank 1 trains on the CPU with ddp_backend nccl, rank 0 on the CPU with mpi");
  CHECK(world().all_reduce_sum(std::int64_t{1}) == 2);
}

TEST_CASE("data parallel: the Accelerator sums each window's gradients over the processes") {
  TensorDataset data = synthetic_images(64, 16);
  auto train_with = [&](ProcessGroup* group, std::int64_t batch, std::int64_t replicas) {
    manual_seed(3);
    auto model = small_mlp()();
    Accelerator accelerator({.gradient_accumulation_steps = 2, .cpu = true, .group = group});
    accelerator.prepare_model(*model);
    optim::ParamStore store(*model);
    optim::AdamW adamw(store, {.lr = 1e-3});
    auto optimizer = accelerator.prepare(adamw);
    DataLoader loader(data, {.batch_size = batch,
                             .shuffle = true,
                             .seed = 9,
                             .prefetch = 0,
                             .num_replicas = replicas,
                             .rank = replicas > 1 ? accelerator.process_index() : 0});
    WindowedLoader windows = accelerator.prepare(loader);
    double loss_sum = 0.0;
    while (auto b = windows.next()) {
      auto scope = accelerator.accumulate(*b);
      nn::ModelOutput o = model->forward(b->batch.inputs, b->batch.labels);
      accelerator.backward(o.loss);
      loss_sum += b->weight * o.loss.item();
      optimizer.step();
      optimizer.zero_grad();
    }
    CHECK(std::isfinite(accelerator.reduce(loss_sum)));
    return model->state_dict();
  };
  const nn::StateDict together = train_with(nullptr, 4, 2);
  const nn::StateDict single = train_with(&ProcessGroup::solo(), 8, 1);
  CHECK(max_difference(together, single) < 1e-6);
  CHECK(same_on_every_rank(together));

  // A loader that is not this process's shard would train every process on the same batches.
  Accelerator accelerator({.cpu = true});
  DataLoader unsharded(data, {.batch_size = 4, .prefetch = 0});
  check_throws_with([&] { accelerator.prepare(unsharded); },
                    "was given a loader sharded as rank 0 of 1");

  // Outside a scope this process's share of the window is unknown: the sum would be twice the
  // mean's.
  auto model = small_mlp()();
  accelerator.prepare_model(*model);
  const Batch b = collate({data.get(0), data.get(1)});
  nn::ModelOutput o = model->forward(b.inputs, b.labels);
  check_throws_with([&] { accelerator.backward(o.loss); },
                    "backward() outside an accumulate() scope in a run of 2 processes");

  // Sources that end apart: both processes are told, rather than one waiting for the other.
  std::int64_t given = 0;
  const std::int64_t mine = world().rank() == 0 ? 2 : 1;
  WindowedLoader uneven = accelerator.prepare([&]() -> std::optional<Batch> {
    if (given == mine) return std::nullopt;
    ++given;
    return collate({data.get(given)});
  });
  CHECK(uneven.next().has_value());
  check_throws_with([&] { uneven.next(); }, "1 of the 2 processes have a window to train on");
}
