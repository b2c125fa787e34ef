// Data-parallel training's single-process parts: the launcher's environment, sharding a loader, a
// window and a dataset, each rank's arguments and the backend's name. The collectives themselves
// run under `mpirun -np 2` (tests/train/test_data_parallel.cpp, ctest's data_parallel entry).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "tests/core/harness.h"
#include "tests/train/trainer_fixtures.h"
#include "train/distributed.h"
#include "train/trainer.h"

using namespace microbatch;
using namespace microbatch::testing;
using namespace microbatch::train;

namespace {

// Sets environment variables for its lifetime, restoring what was there.
struct EnvGuard {
  explicit EnvGuard(std::vector<std::pair<std::string, std::string>> values) {
    for (auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~EnvGuard() {
    for (auto& [name, old] : saved) {
      if (old) {
        setenv(name.c_str(), old->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
};

std::vector<std::int64_t> all_indices(DataLoader& loader) {
  std::vector<std::int64_t> out;
  for (std::int64_t b = 0; b < loader.num_batches(); ++b) {
    for (std::int64_t i : loader.batch_indices(b)) out.push_back(i);
  }
  return out;
}

}  // namespace

TEST_CASE("distributed: the launcher's environment gives the size, rank and local rank") {
  {
    EnvGuard env({{"OMPI_COMM_WORLD_SIZE", "4"},
                  {"OMPI_COMM_WORLD_RANK", "3"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
    const LaunchInfo info = launch_info();
    CHECK(info.size == 4);
    CHECK(info.rank == 3);
    CHECK(info.local_rank == 1);
  }
  {
    EnvGuard env({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "2"}});
    check_throws_with([] { launch_info(); },
                      "OMPI_COMM_WORLD_RANK = '2' is not a whole number in [0, 1]");
  }
  {
    EnvGuard env({{"PMI_SIZE", "two"}, {"PMI_RANK", "0"}});
    check_throws_with([] { launch_info(); }, "PMI_SIZE = 'two'");
  }
  // This suite runs as one process, outside any launcher.
  CHECK(ProcessGroup::world().size() == 1);
  CHECK(ProcessGroup::world().is_main());
  CHECK(ProcessGroup::solo().size() == 1);
}

TEST_CASE("distributed: a world of one sums nothing and refuses no input") {
  ProcessGroup& group = ProcessGroup::solo();
  Tensor t = from_vector({1.0, 2.0, 3.0}, {3});
  group.all_reduce_sum(t);
  check_close(t, {1.0, 2.0, 3.0}, 0, 0);
  CHECK(group.all_reduce_sum(2.5) == 2.5);
  CHECK(group.all_reduce_sum(std::int64_t{7}) == 7);
  CHECK(group.all_reduce_max(std::int64_t{7}) == 7);
  CHECK(group.all_gather({4, 5}) == std::vector<std::int64_t>{4, 5});
  group.broadcast(t);
  check_close(t, {1.0, 2.0, 3.0}, 0, 0);
  Tensor strided = from_vector({1.0, 2.0, 3.0, 4.0}, {2, 2}).transpose(0, 1);
  check_throws_with([&] { group.all_reduce_sum(strided); }, "needs a contiguous tensor");
  check_throws_with([&] { group.broadcast(t, 1); }, "broadcast from rank 1 in a world of 1");
  check_throws_with([&] { group.use(DdpBackend::Mpi, cuda_device(0)); }, "sums host memory");
  check_throws_with([&] { group.use(DdpBackend::Nccl, kCPU); }, "sums CUDA device memory");
}

TEST_CASE("distributed: ddp_backend names") {
  ProcessGroup& one = ProcessGroup::solo();
  CHECK(parse_ddp_backend("auto", one, kCPU) == DdpBackend::None);
  CHECK(parse_ddp_backend("", one, cuda_device(0)) == DdpBackend::None);
  CHECK(parse_ddp_backend("mpi", one, kCPU) == DdpBackend::Mpi);
  CHECK(parse_ddp_backend("nccl", one, cuda_device(0)) == DdpBackend::Nccl);
  check_throws_with([&] { parse_ddp_backend("gloo", one, kCPU); },
                    "must be auto, mpi or nccl, got 'gloo'");
  TrainingArguments args;
  args.ddp_backend = "gloo";
  check_throws_with([&] { args.validate(); }, "ddp_backend must be auto, mpi or nccl, got 'gloo'");
  args.ddp_backend = "nccl";
  args.validate();
  CHECK(TrainingArguments::from_json(args.to_json()).ddp_backend == "nccl");
}

TEST_CASE("distributed: a window's shares partition it, in the ranks' turn") {
  const std::vector<std::int64_t> window{10, 11, 12, 13, 14, 15, 16};
  CHECK(window_share(window, 0, 3) == std::vector<std::int64_t>{10, 13, 16});
  CHECK(window_share(window, 1, 3) == std::vector<std::int64_t>{11, 14});
  CHECK(window_share(window, 2, 3) == std::vector<std::int64_t>{12, 15});
  CHECK(window_share({5}, 1, 2).empty());  // a short last window leaves a rank without samples
  CHECK(window_share(window, 0, 1) == window);
  for (int size = 1; size <= 5; ++size) {
    std::int64_t total = 0;
    for (int rank = 0; rank < size; ++rank) total += share_size(7, rank, size);
    CHECK(total == 7);
  }
  check_throws_with([] { share_size(7, 2, 2); }, "rank 2 of 2");
}

TEST_CASE("distributed: a sharded DataLoader pads as DistributedSampler and splits the epoch") {
  TensorDataset data = synthetic_images(10, 3);
  DataLoader whole(data, {.batch_size = 100, .shuffle = true, .seed = 5, .prefetch = 0});
  whole.set_epoch(1);
  const std::vector<std::int64_t> order = all_indices(whole);
  std::set<std::int64_t> seen;
  for (std::int64_t rank = 0; rank < 3; ++rank) {
    DataLoader shard(data, {.batch_size = 3,
                            .shuffle = true,
                            .seed = 5,
                            .prefetch = 0,
                            .num_replicas = 3,
                            .rank = rank});
    shard.set_epoch(1);
    CHECK(shard.samples_per_epoch() == 4);  // ceil(10 / 3), the order padded to 12
    CHECK(shard.num_batches() == 2);
    const std::vector<std::int64_t> mine = all_indices(shard);
    REQUIRE(mine.size() == 4);
    for (std::int64_t i = 0; i < 4; ++i) {
      // Position rank + 3i of the padded order; positions 10 and 11 repeat its first two.
      CHECK(mine[i] == order[(rank + 3 * i) % 10]);
      seen.insert(mine[i]);
    }
  }
  CHECK(seen.size() == 10);
  check_throws_with([&] { DataLoader bad(data, {.batch_size = 2, .num_replicas = 2, .rank = 2}); },
                    "rank 2 of num_replicas 2");
}

TEST_CASE("distributed: a dataset shard holds the rank's examples") {
  TensorDataset data = synthetic_images(5, 4);
  DatasetShard shard(data, 1, 2);
  CHECK(shard.size() == 2);
  check_close(shard.get(1).input, data.get(3).input, 0, 0);
  check_throws_with([&] { shard.get(2); }, "index 2 out of range");
  check_throws_with([&] { DatasetShard bad(data, 2, 2); }, "rank 2 of 2");
}

TEST_CASE("distributed: a window is every rank's batch, at most the training set") {
  CHECK(global_window(8, 70, 2) == 16);
  CHECK(global_window(8, 70, 1) == 8);
  CHECK(global_window(34, 70, 2) == 68);
  CHECK(global_window(35, 70, 2) == 70);  // ceil(70 / 2): the whole set
  CHECK(global_window(36, 71, 2) == 71);
  CHECK(global_window(100, 70, 1) == 70);
  CHECK(global_window(INT64_MAX, 10, 3) == 10);  // no overflow of the product
}

TEST_CASE("distributed: one plan for every rank's share of a window cut to the training set") {
  // 9 examples, 5 a rank over 2 processes: one window of all 9, 5 for rank 0 and 4 for rank 1.
  // Planning needs no other process: plan_training takes the world's size. The plan's counts are
  // rank 0's, the largest share.
  TensorDataset data = synthetic_images(9, 6);
  TrainingArguments args{
      .per_device_train_batch_size = 5, .memory_budget = 64 << 20, .use_cpu = true};
  CHECK(plan_training(small_mlp(), args, data, kCPU, 2).effective_batch == 5);
  CHECK(plan_training(small_mlp(), args, data, kCPU, 1).effective_batch == 5);
  args.per_device_train_batch_size = 12;
  CHECK(plan_training(small_mlp(), args, data, kCPU, 1).effective_batch == 9);
  CHECK(plan_training(small_mlp(), args, data, kCPU, 2).effective_batch == 5);
  CHECK(plan_training(small_mlp(), args, data, kCPU, 3).effective_batch == 3);
  args.memory_budget = 0;  // without a budget, the split asked for
  CHECK(plan_training(small_mlp(), args, data, kCPU, 2).effective_batch == 5);
  CHECK_THROWS_WITH_AS(plan_training(small_mlp(), args, data, kCPU, 0),
                       doctest::Contains("at least one process"), Error);
}

TEST_CASE("distributed: the ranks' plan fits the rank whose windows need the most") {
  // Note [Agreed plans]: 2 processes, windows of 8 a rank over 33 examples. Rank 0's share of the
  // epoch's last window is 1 example and rank 1's is none, so rank 0 alone runs a micro-batch of
  // 1, which takes cache blocks of its own (Note [Uneven windows]). Each rank's windows are those
  // of one process with windows of 8 over 33 examples (rank 0) or 32 (rank 1); under a budget
  // that holds rank 1's windows of 8 and not rank 0's, each would plan differently alone.
  TensorDataset rank0_alone = synthetic_images(33, 6), rank1_alone = synthetic_images(32, 6);
  TensorDataset both = synthetic_images(33, 6);
  TrainingArguments args{.per_device_train_batch_size = kAutoBatch,
                         .train_batch_size = 8,
                         .memory_budget = std::int64_t{1} << 30,
                         .use_cpu = true};
  const MemoryPlan roomy0 = plan_training(small_mlp(), args, rank0_alone, kCPU);
  const MemoryPlan roomy1 = plan_training(small_mlp(), args, rank1_alone, kCPU);
  REQUIRE(roomy0.micro_batch_size == 8);
  REQUIRE(roomy1.micro_batch_size == 8);
  INFO("windows of 8: rank 0's peak " << roomy0.predicted_peak << ", rank 1's "
                                      << roomy1.predicted_peak);
  REQUIRE(roomy0.predicted_peak > roomy1.predicted_peak);  // the tail's blocks
  // The least budget whose usable part (less the 5% margin) holds rank 1's window of 8.
  args.memory_budget = static_cast<std::int64_t>(
      std::ceil(static_cast<double>(roomy1.predicted_peak) / (1.0 - roomy1.margin)));
  const MemoryPlan alone0 = plan_training(small_mlp(), args, rank0_alone, kCPU);
  const MemoryPlan alone1 = plan_training(small_mlp(), args, rank1_alone, kCPU);
  REQUIRE(alone1.micro_batch_size == 8);
  REQUIRE(alone0.micro_batch_size < 8);  // the ranks would disagree

  TrainingArguments world_args = args;
  world_args.train_batch_size = 16;
  const MemoryPlan agreed =
      plan_training(small_mlp(), rank_arguments(world_args, 2), both, kCPU, 2);
  CHECK(agreed.micro_batch_size == alone0.micro_batch_size);
  CHECK(agreed.gradient_checkpointing == alone0.gradient_checkpointing);
  CHECK(agreed.predicted_peak == alone0.predicted_peak);
  CHECK(agreed.predicted_peak <= args.memory_budget);
}

TEST_CASE("distributed: the ranks' plan fits a rank other than rank 0 that needs more") {
  // 7 examples over 2 processes, a window of all 7: rank 0 takes 4 and rank 1 takes 3. In
  // micro-batches of 2, rank 0's window is 2 + 2 and rank 1's is 2 + 1, whose last micro-batch
  // takes cache blocks of its own: rank 1 needs more, though its share is the smaller.
  TensorDataset rank0_alone = synthetic_images(4, 6), rank1_alone = synthetic_images(3, 6);
  TensorDataset both = synthetic_images(7, 6);
  TrainingArguments fixed{
      .per_device_train_batch_size = 2, .memory_budget = std::int64_t{1} << 30, .use_cpu = true};
  fixed.train_batch_size = 4;
  const std::int64_t peak0 = plan_training(small_mlp(), fixed, rank0_alone, kCPU).predicted_peak;
  fixed.train_batch_size = 3;
  const std::int64_t peak1 = plan_training(small_mlp(), fixed, rank1_alone, kCPU).predicted_peak;
  INFO("windows in micro-batches of 2: rank 0's peak " << peak0 << ", rank 1's " << peak1);
  REQUIRE(peak1 > peak0);
  // The least budget that holds rank 0's windows of 2 and not rank 1's.
  TrainingArguments args{
      .per_device_train_batch_size = kAutoBatch,
      .train_batch_size = 4,
      .memory_budget = static_cast<std::int64_t>(std::ceil(static_cast<double>(peak0) / 0.95)),
      .use_cpu = true};
  const MemoryPlan alone0 = plan_training(small_mlp(), args, rank0_alone, kCPU);
  REQUIRE(alone0.micro_batch_size == 2);
  REQUIRE_FALSE(alone0.gradient_checkpointing);
  REQUIRE(peak1 > static_cast<std::int64_t>(static_cast<double>(args.memory_budget) * 0.95));
  args.train_batch_size = 8;
  const MemoryPlan agreed = plan_training(small_mlp(), rank_arguments(args, 2), both, kCPU, 2);
  INFO("agreed: " << agreed.micro_batch_size
                  << (agreed.gradient_checkpointing ? " with" : " without")
                  << " checkpointing, peak " << agreed.predicted_peak);
  CHECK(agreed.effective_batch == 4);
  CHECK((agreed.micro_batch_size < 2 || agreed.gradient_checkpointing));
  CHECK(agreed.predicted_peak <= args.memory_budget);
}

TEST_CASE("distributed: each rank's arguments hold its share of the effective batch") {
  TrainingArguments args{.per_device_train_batch_size = 4, .gradient_accumulation_steps = 2};
  // Hugging Face's count: per device x accumulation steps on each rank, that x world in all.
  CHECK(rank_arguments(args, 2).train_batch_size == 0);
  args.train_batch_size = 16;
  args.gradient_accumulation_steps = 1;
  CHECK(rank_arguments(args, 2).train_batch_size == 8);
  CHECK(rank_arguments(args, 1).train_batch_size == 16);
  args.train_batch_size = 15;
  check_throws_with([&] { rank_arguments(args, 2); },
                    "train_batch_size 15 is not divisible by the 2 processes");
}
