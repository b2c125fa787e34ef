#include "train/distributed.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/half.h"

#ifdef MB_HAVE_MPI
// The C interface alone: Open MPI's and MPICH's C++ bindings are deprecated and warn.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif
#ifdef MB_HAVE_NCCL
#include <nccl.h>

#include <functional>
#include <string>

#include "kernels/cuda/runtime.h"
#endif

namespace microbatch::train {

const char* ddp_backend_name(DdpBackend backend) {
  switch (backend) {
    case DdpBackend::None:
      return "no";
    case DdpBackend::Mpi:
      return "mpi";
    case DdpBackend::Nccl:
      return "nccl";
  }
  return "?";
}

bool mpi_built() {
#ifdef MB_HAVE_MPI
  return true;
#else
  return false;
#endif
}

namespace {

// The first of `names` set in the environment, as a whole number in [lo, hi]; nullopt when none is.
std::optional<int> env_int(std::initializer_list<const char*> names, int lo, int hi) {
  for (const char* name : names) {
    const char* text = std::getenv(name);
    if (text == nullptr) continue;
    const std::string_view s(text);
    int value = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
    MB_CHECK(ec == std::errc() && end == s.data() + s.size() && value >= lo && value <= hi,
             "[distributed] the launcher's {} = '{}' is not a whole number in [{}, {}]", name, s,
             lo, hi);
    return value;
  }
  return std::nullopt;
}

}  // namespace

LaunchInfo launch_info() {
  LaunchInfo info;
  // Open MPI's mpirun, then MPICH's (and Intel MPI's) Hydra. Slurm's variables are not read: a
  // batch script's SLURM_NTASKS counts the tasks of the allocation, not of this program.
  const std::optional<int> size = env_int({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1, INT_MAX);
  if (!size) return info;
  info.size = *size;
  info.rank = env_int({"OMPI_COMM_WORLD_RANK", "PMI_RANK"}, 0, info.size - 1).value_or(0);
  // Without a local rank every rank is taken to be on one machine (rank_device then refuses more
  // ranks than that machine's GPUs, unless CUDA_VISIBLE_DEVICES shows each its own).
  info.local_rank = env_int({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}, 0, info.size - 1)
                        .value_or(info.rank);
  return info;
}

#ifdef MB_HAVE_NCCL
namespace {

// NCCL takes one GPU a rank, and refuses ranks that share one inside ncclCommInitRank, where a
// rank that fails leaves the others waiting. Ranks whose CUDA_VISIBLE_DEVICES or `cuda:N` named the
// same GPU of the same machine are refused here instead, on every rank alike (Note [Failing
// together]). A rank's GPU is known by its UUID (unique across machines), as a hash.
void refuse_shared_gpus(ProcessGroup& group, Device device) {
  if (group.size() == 1) return;
  std::int64_t key = 0;
  group.together("naming its GPU", [&] {
    cudaDeviceProp prop{};
    MB_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.index));
    key = static_cast<std::int64_t>(std::hash<std::string>{}(
        std::string(prop.uuid.bytes, sizeof prop.uuid.bytes)));
  });
  const std::vector<std::int64_t> keys = group.all_gather({key, device.index});
  group.together("comparing its GPU with the other ranks'", [&] {
    for (int a = 0; a < group.size(); ++a) {
      for (int b = a + 1; b < group.size(); ++b) {
        const auto at = [](int r) { return static_cast<std::size_t>(r) * 2; };
        MB_CHECK(keys[at(a)] != keys[at(b)],
                 "[distributed] ranks {} and {} train on one GPU (cuda:{} and cuda:{} as each sees "
                 "it): NCCL needs a GPU for each rank. Launch as many ranks a machine as it has "
                 "GPUs, and let each rank take cuda:(local rank), or give each its own "
                 "CUDA_VISIBLE_DEVICES",
                 a, b, keys[at(a) + 1], keys[at(b) + 1]);
      }
    }
  });
}

}  // namespace

struct ProcessGroup::Nccl {
  ncclComm_t comm = nullptr;
  int device = 0;
  // After an error the communicator is aborted: ncclCommDestroy may wait for the other ranks, or
  // for work that a failed device will not finish.
  void abort_communicator() {
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
  }
  ~Nccl() {
    if (comm != nullptr) ncclCommDestroy(comm);
  }
};

#define MB_NCCL_CHECK(call)                                                   \
  do {                                                                        \
    ncclResult_t mb_result_ = (call);                                         \
    MB_CHECK(mb_result_ == ncclSuccess, "[distributed] {} failed: {}", #call, \
             ncclGetErrorString(mb_result_));                                 \
  } while (0)
#else
struct ProcessGroup::Nccl {};
#endif

ProcessGroup& ProcessGroup::world() {
  static ProcessGroup group;
  static const bool made = [] {
    const LaunchInfo info = launch_info();
    if (info.size == 1) return true;
#ifdef MB_HAVE_MPI
    int started = 0;
    MPI_Initialized(&started);
    if (!started) {
      // Only this thread calls MPI (the DataLoader's prefetch threads never do).
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      group.mpi_started_ = true;
    }
    int size = 0, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MB_CHECK(size == info.size && rank == info.rank,
             "[distributed] the launcher says rank {} of {}, MPI says rank {} of {}", info.rank,
             info.size, rank, size);
#else
    MB_CHECK(false,
             "[distributed] launched as rank {} of {} processes, but this build has no MPI "
             "(install libopenmpi-dev and rebuild, or run one process)",
             info.rank, info.size);
#endif
    group.size_ = info.size;
    group.rank_ = info.rank;
    group.local_rank_ = info.local_rank;
    return true;
  }();
  (void)made;
  return group;
}

ProcessGroup& ProcessGroup::solo() {
  static ProcessGroup group;
  return group;
}

ProcessGroup::~ProcessGroup() { finalize(); }

void ProcessGroup::finalize(Ending ending) {
#ifdef MB_HAVE_NCCL
  if (nccl_ && ending == Ending::AfterError) nccl_->abort_communicator();
#else
  (void)ending;
#endif
  nccl_.reset();
  backend_ = DdpBackend::None;
#ifdef MB_HAVE_MPI
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (mpi_started_ && !finalized) MPI_Finalize();
#endif
  mpi_started_ = false;
}

void ProcessGroup::use(DdpBackend backend, Device device) {
  // Refused on every rank together: a rank that refused alone would leave the others waiting in
  // NCCL's set-up (Note [Failing together]).
  together("readying its ddp_backend", [&] {
    switch (backend) {
      case DdpBackend::None:
        MB_CHECK(size_ == 1,
                 "[distributed] no backend in a world of {} processes: their gradients "
                 "would never be summed",
                 size_);
        break;
      case DdpBackend::Mpi:
        MB_CHECK(device.is_cpu(),
                 "[distributed] ddp_backend = mpi sums host memory, and training is "
                 "on {}: use ddp_backend = nccl, or train on the CPU",
                 device.str());
        break;
      case DdpBackend::Nccl:
        MB_CHECK(device.is_cuda(),
                 "[distributed] ddp_backend = nccl sums CUDA device memory, and "
                 "training is on {}: use ddp_backend = mpi",
                 device.str());
#ifndef MB_HAVE_NCCL
        MB_CHECK(false,
                 "[distributed] ddp_backend = nccl, but this build has no NCCL (a CUDA build "
                 "with MPI links it where the CUDA folder holds libnccl)");
#endif
        break;
    }
  });
#ifdef MB_HAVE_NCCL
  // A communicator is made when any rank lacks one on its device, by every rank together.
  const bool make = backend == DdpBackend::Nccl &&
                    all_reduce_max(nccl_ && nccl_->device == device.index ? 0 : 1) == 1;
  if (make) {
    nccl_.reset();
    refuse_shared_gpus(*this, device);
    ncclUniqueId id{};
    together("readying NCCL", [&] {
      if (rank_ == 0) MB_NCCL_CHECK(ncclGetUniqueId(&id));
      MB_CUDA_CHECK(cudaSetDevice(device.index));
    });
    if (size_ > 1) {
      MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
      // ncclCommInitRank makes no MPI call: rank 0's broadcast is done on every rank before any
      // waits in NCCL (some MPI libraries' collectives otherwise hang with it).
      MPI_Barrier(MPI_COMM_WORLD);
    }
    auto nccl = std::make_unique<Nccl>();
    nccl->device = device.index;
    // A rank whose ncclCommInitRank fails leaves the others in theirs: the command's MPI_Abort
    // ends them (Note [Failing together]).
    MB_NCCL_CHECK(ncclCommInitRank(&nccl->comm, size_, id, rank_));
    nccl_ = std::move(nccl);
  }
#endif
  backend_ = backend;
}

namespace {

#ifdef MB_HAVE_MPI
MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i64:
      return MPI_INT64_T;
    default:
      break;
  }
  MB_CHECK(false, "[distributed] MPI cannot sum {} tensors (f32, f64, f16, bf16 and i64 only)",
           dtype_name(dtype));
  return MPI_DATATYPE_NULL;
}
#endif

#ifdef MB_HAVE_NCCL
ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
      return ncclBfloat16;
#else
      MB_CHECK(false,
               "[distributed] this NCCL ({}) has no bf16: sum bf16 gradients with NCCL 2.10 or "
               "later, or keep f32 gradients",
               NCCL_VERSION_CODE);
      break;
#endif
    case DType::i64:
      return ncclInt64;
    default:
      break;
  }
  MB_CHECK(false, "[distributed] NCCL cannot sum {} tensors", dtype_name(dtype));
  return ncclFloat32;
}
#endif

// Elements per MPI call: the counts are ints, and a few large buckets keep every call long.
constexpr std::int64_t kBucket = std::int64_t{1} << 26;
// Elements of a 16-bit tensor summed in f32 per MPI call: a 4 MiB host buffer.
constexpr std::int64_t kWideBucket = std::int64_t{1} << 20;

#ifdef MB_HAVE_MPI
// MPI has no 16-bit floating-point sum: an f16 or bf16 tensor is widened to f32 a bucket at a
// time, summed in f32 over the ranks, and rounded back once, the same on every rank (NCCL rounds
// after each rank's addition instead). The buffer is the collective's own, as MPI's are, outside
// the allocator and its budget.
void all_reduce_16bit(std::uint16_t* bits, std::int64_t n, float (*widen)(std::uint16_t),
                      std::uint16_t (*narrow)(float)) {
  std::vector<float> wide(static_cast<std::size_t>(std::min(n, kWideBucket)));
  for (std::int64_t at = 0; at < n; at += kWideBucket) {
    const auto m = static_cast<std::size_t>(std::min(kWideBucket, n - at));
    std::uint16_t* chunk = bits + at;
    for (std::size_t i = 0; i < m; ++i) wide[i] = widen(chunk[i]);
    MPI_Allreduce(MPI_IN_PLACE, wide.data(), static_cast<int>(m), MPI_FLOAT, MPI_SUM,
                  MPI_COMM_WORLD);
    for (std::size_t i = 0; i < m; ++i) chunk[i] = narrow(wide[i]);
  }
}
#endif

void check_collective_tensor(const Tensor& t, const char* what) {
  MB_CHECK(t.defined(), "[distributed] {} of an undefined tensor", what);
  MB_CHECK(t.is_contiguous(), "[distributed] {} needs a contiguous tensor, got shape {}", what,
           shape_str(t.shape()));
}

}  // namespace

void* ProcessGroup::device_comm(const Tensor& t, const char* doing) {
#ifdef MB_HAVE_NCCL
  MB_CHECK(nccl_ && nccl_->device == t.device().index,
           "[distributed] {} a tensor on {} needs ddp_backend = nccl on that device", doing,
           t.device().str());
  MB_CUDA_CHECK(cudaSetDevice(t.device().index));
  return nccl_->comm;
#else
  MB_CHECK(false, "[distributed] {} a tensor on {} needs NCCL, which this build lacks", doing,
           t.device().str());
  return nullptr;
#endif
}

void ProcessGroup::all_reduce_sum(Tensor& t) {
  check_collective_tensor(t, "all_reduce_sum");
  if (size_ == 1 || t.numel() == 0) return;
  if (t.device().is_cuda()) {
    [[maybe_unused]] void* comm = device_comm(t, "summing");
#ifdef MB_HAVE_NCCL
    MB_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<std::size_t>(t.numel()),
                                nccl_type(t.dtype()), ncclSum, static_cast<ncclComm_t>(comm),
                                kernels::cuda::current_stream()));
#endif
    return;
  }
  MB_CHECK(t.device().is_cpu(), "[distributed] cannot sum a tensor on {}", t.device().str());
#ifdef MB_HAVE_MPI
  if (t.dtype() == DType::f16 || t.dtype() == DType::bf16) {
    auto* bits = static_cast<std::uint16_t*>(t.raw_data());
    if (t.dtype() == DType::f16) {
      all_reduce_16bit(bits, t.numel(), half_bits_to_float, float_to_half_bits);
    } else {
      all_reduce_16bit(bits, t.numel(), bf16_bits_to_float, float_to_bf16_bits);
    }
    return;
  }
  const MPI_Datatype type = mpi_type(t.dtype());
  char* p = static_cast<char*>(t.raw_data());
  const std::size_t elem = dtype_size(t.dtype());
  for (std::int64_t at = 0; at < t.numel(); at += kBucket) {
    const std::int64_t n = std::min(kBucket, t.numel() - at);
    MPI_Allreduce(MPI_IN_PLACE, p + static_cast<std::size_t>(at) * elem, static_cast<int>(n), type,
                  MPI_SUM, MPI_COMM_WORLD);
  }
#endif
}

double ProcessGroup::all_reduce_sum(double value) {
#ifdef MB_HAVE_MPI
  if (size_ > 1) MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
#endif
  return value;
}

std::int64_t ProcessGroup::all_reduce_sum(std::int64_t value) {
#ifdef MB_HAVE_MPI
  if (size_ > 1) MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
#endif
  return value;
}

std::int64_t ProcessGroup::all_reduce_max(std::int64_t value) {
#ifdef MB_HAVE_MPI
  if (size_ > 1) MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
#endif
  return value;
}

namespace {

// The last exception every rank threw together (ProcessGroup::shared).
std::exception_ptr g_last_shared;

// An exception's message, whatever it is.
std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace

void ProcessGroup::settle(std::exception_ptr mine, const std::string& doing) {
  // The lowest failing rank, as size - rank under a maximum (0: none failed).
  const std::int64_t lowest = all_reduce_max(mine ? size_ - rank_ : 0);
  if (lowest == 0) return;
  // Anything else was another collective's value: a rank is elsewhere in the run.
  MB_CHECK(lowest > 0 && lowest <= size_,
           "[distributed] the ranks' collectives are out of step (rank {} of {} got {} while {}): "
           "were they given different arguments?",
           rank_, size_, lowest, doing);
  if (all_reduce_sum(std::int64_t{mine ? 1 : 0}) == size_) {
    // Every rank failed at the same point (a refusal every rank makes alike, a callback's own
    // stop): each throws its own exception, of its own type, as one process would.
    g_last_shared = mine;
    std::rethrow_exception(mine);
  }
  const int root = size_ - static_cast<int>(lowest);
  std::string message = root == rank_ ? message_of(mine) : std::string();
  broadcast(message, root);
  // What the failing rank threw: 0 for an error, else an out-of-memory error's request + 1 (the
  // other ranks give 0 to the maximum).
  std::int64_t out_of_memory = 0;
  if (root == rank_) {
    try {
      std::rethrow_exception(mine);
    } catch (const OutOfMemoryError& e) {
      out_of_memory = static_cast<std::int64_t>(e.requested()) + 1;
    } catch (...) {
    }
  }
  out_of_memory = all_reduce_max(out_of_memory);
  if (root != rank_) {
    message =
        fmt::format("[distributed] rank {} of {} failed while {}: {}", root, size_, doing, message);
  }
  if (out_of_memory > 0)
    throw SharedOutOfMemoryError(message, static_cast<std::size_t>(out_of_memory - 1), root);
  throw SharedError(message, root);
}

bool ProcessGroup::shared(const std::exception_ptr& error) {
  if (!error) return false;
  if (error == g_last_shared) return true;
  try {
    std::rethrow_exception(error);
  } catch (const SharedFailure&) {
    return true;
  } catch (...) {
    return false;
  }
}

std::vector<std::int64_t> ProcessGroup::all_gather(const std::vector<std::int64_t>& mine) {
  if (size_ == 1) return mine;
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size_));
#ifdef MB_HAVE_MPI
  MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_INT64_T, all.data(),
                static_cast<int>(mine.size()), MPI_INT64_T, MPI_COMM_WORLD);
#endif
  return all;
}

void ProcessGroup::broadcast(Tensor& t, int root) {
  check_collective_tensor(t, "broadcast");
  MB_CHECK(root >= 0 && root < size_, "[distributed] broadcast from rank {} in a world of {}", root,
           size_);
  if (size_ == 1 || t.numel() == 0) return;
  if (t.device().is_cuda()) {
    [[maybe_unused]] void* comm = device_comm(t, "broadcasting");
#ifdef MB_HAVE_NCCL
    MB_NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), t.nbytes(), ncclUint8, root,
                                static_cast<ncclComm_t>(comm), kernels::cuda::current_stream()));
#endif
    return;
  }
  MB_CHECK(t.device().is_cpu(), "[distributed] cannot broadcast a tensor on {}", t.device().str());
  broadcast_bytes(t.raw_data(), static_cast<std::int64_t>(t.nbytes()), root);
}

std::int64_t ProcessGroup::broadcast_size(std::int64_t n, int root) {
  MB_CHECK(root >= 0 && root < size_, "[distributed] broadcast from rank {} in a world of {}", root,
           size_);
#ifdef MB_HAVE_MPI
  if (size_ > 1) MPI_Bcast(&n, 1, MPI_INT64_T, root, MPI_COMM_WORLD);
#endif
  return n;
}

void ProcessGroup::broadcast_bytes(void* data, std::int64_t bytes, int root) {
  if (size_ == 1) return;
#ifdef MB_HAVE_MPI
  char* p = static_cast<char*>(data);
  for (std::int64_t at = 0; at < bytes; at += kBucket) {
    MPI_Bcast(p + at, static_cast<int>(std::min(kBucket, bytes - at)), MPI_BYTE, root,
              MPI_COMM_WORLD);
  }
#else
  (void)data;
  (void)bytes;
  (void)root;
#endif
}

void ProcessGroup::abort_if_distributed(int code) {
#ifdef MB_HAVE_MPI
  int started = 0, finalized = 0;
  MPI_Initialized(&started);
  MPI_Finalized(&finalized);
  if (started && !finalized && launch_info().size > 1) MPI_Abort(MPI_COMM_WORLD, code);
#endif
}

void ProcessGroup::barrier() {
#ifdef MB_HAVE_MPI
  if (size_ > 1) MPI_Barrier(MPI_COMM_WORLD);
#endif
}

Device rank_device(const ProcessGroup& group, Device device) {
  if (group.size() == 1 || !device.is_cuda()) return device;
  const int count = cuda_device_count();
  // A launcher that shows each process its own GPU alone (CUDA_VISIBLE_DEVICES) leaves it cuda:0;
  // without that, local ranks past the first would share the one GPU, which NCCL refuses.
  if (count == 1 && (group.local_rank() == 0 || std::getenv("CUDA_VISIBLE_DEVICES") != nullptr))
    return cuda_device(0);
  MB_CHECK(group.local_rank() < count,
           "[distributed] rank {} is local rank {} on this machine, which has {} CUDA device(s): "
           "start at most one process per GPU",
           group.rank(), group.local_rank(), count);
  return cuda_device(group.local_rank());
}

DdpBackend parse_ddp_backend(const std::string& name, const ProcessGroup& group, Device device) {
  if (name.empty() || name == "auto") {
    if (group.size() == 1) return DdpBackend::None;
    return device.is_cuda() ? DdpBackend::Nccl : DdpBackend::Mpi;
  }
  if (name == "mpi") return DdpBackend::Mpi;
  if (name == "nccl") return DdpBackend::Nccl;
  MB_CHECK(false, "[distributed] ddp_backend must be auto, mpi or nccl, got '{}'", name);
  return DdpBackend::None;
}

Device prepare_rank(ProcessGroup& group, Device device, DeviceIndex index,
                    const std::string& ddp_backend) {
  if (group.size() == 1) return device;
  DdpBackend backend = DdpBackend::None;
  // A rank without its GPU, or with a backend name it cannot read, fails before NCCL's collectives.
  group.together("choosing its device and backend", [&] {
    if (index == DeviceIndex::Default) device = rank_device(group, device);
    backend = parse_ddp_backend(ddp_backend, group, device);
  });
  // Ranks that chose differently (one whose GPU is not there trains on the CPU under "auto") would
  // sum with different backends: refused on every rank alike, and so shared.
  const std::vector<std::int64_t> all = group.all_gather(
      {static_cast<std::int64_t>(backend), static_cast<std::int64_t>(device.type)});
  auto kind = [](std::int64_t type) {
    return static_cast<DeviceType>(type) == DeviceType::cuda ? "a CUDA device" : "the CPU";
  };
  group.together("comparing its device and backend with rank 0's", [&] {
    for (int r = 1; r < group.size(); ++r) {
      const std::size_t at = static_cast<std::size_t>(r) * 2;
      MB_CHECK(all[at] == all[0] && all[at + 1] == all[1],
               "[distributed] rank {} trains on {} with ddp_backend {}, rank 0 on {} with {}: "
               "every rank must train on the same kind of device, with the same backend",
               r, kind(all[at + 1]), ddp_backend_name(static_cast<DdpBackend>(all[at])),
               kind(all[1]), ddp_backend_name(static_cast<DdpBackend>(all[0])));
    }
  });
  group.use(backend, device);
  return device;
}

std::int64_t share_size(std::int64_t n, int rank, int size) {
  MB_CHECK(size >= 1 && rank >= 0 && rank < size, "[distributed] rank {} of {}", rank, size);
  return n / size + (rank < n % size ? 1 : 0);
}

std::vector<std::int64_t> window_share(const std::vector<std::int64_t>& window, int rank,
                                       int size) {
  const auto n = static_cast<std::int64_t>(window.size());
  std::vector<std::int64_t> share;
  share.reserve(static_cast<std::size_t>(share_size(n, rank, size)));
  for (std::int64_t i = rank; i < n; i += size)
    share.push_back(window[static_cast<std::size_t>(i)]);
  return share;
}

DatasetShard::DatasetShard(const Dataset& base, int rank, int size)
    : base_(base), rank_(rank), size_(size) {
  MB_CHECK(size >= 1 && rank >= 0 && rank < size, "[DatasetShard] rank {} of {}", rank, size);
}

Example DatasetShard::get(std::int64_t index) const {
  check_index(index, "DatasetShard");
  return base_.get(rank_ + index * size_);
}

}  // namespace microbatch::train
