// Data-parallel training: the processes a run was launched with, and the few collectives it needs.
//
// Note [Data parallel]: `mpirun -np W microbatch train ...` starts W copies of a run; each finds
// its place (rank r of W) here, and the world is made once, on first use, from the launcher's
// environment (Open MPI's OMPI_COMM_WORLD_SIZE, or PMI_SIZE from MPICH's Hydra; the local rank
// from OMPI_COMM_WORLD_LOCAL_RANK or MPI_LOCALRANKID). A process not
// started by a launcher is a world of one, and nothing here costs it anything.
//
// Every rank holds the whole model and reads the same global order of samples. The Trainer cuts
// each window of the effective batch into W shares (rank r takes the window's samples r, r + W,
// r + 2W, ...) and weighs each micro-batch by its share of the whole window's loss-bearing items,
// which every rank counts from the labels alone (Note [Exact accumulation] in
// train/accelerator.h). So the ranks' gradients add up to the full window's mean-loss gradient,
// and one sum over the ranks per window, never per micro-batch, gives every rank the gradient a
// single process would have: the same step follows on each, to rounding (the sum is taken in
// another order). The sum, the window's loss and the evaluation's loss are the collectives of a
// step; the boundary step itself (norm, clip, found_inf, AdamW, the loss scale) then runs on
// identical gradients on every rank and needs none.
//
// Backends (TrainingArguments::ddp_backend, Hugging Face's name): "mpi" sums host memory with
// MPI_Allreduce, so it serves CPU training; "nccl" sums device memory with ncclAllReduce on the
// current stream (no host synchronisation), so it serves CUDA training, rank r on cuda:(local
// rank). A build without MPI runs worlds of one only, and a build without NCCL trains on the GPU
// alone.
//
// Note [Failing together]: an error on one rank only (a corrupt example in its share, a
// micro-batch that does not fit even when split to one sample, a log or checkpoint that rank 0
// alone cannot write) would leave the other ranks waiting for it in their next collective, for
// ever: a launcher ends them only when a process exits, and a program that catches the error and
// goes on does not exit. So the Trainer runs each stretch of its work between two collectives
// inside ProcessGroup::together(): afterwards every rank learns, in one all-reduce of a number,
// whether any rank failed. When every rank failed (a refusal each makes alike, a step callback's
// own stop), each rethrows its own exception, of its own type, as one process would. When some
// did, every rank throws a SharedFailure of one kind: SharedOutOfMemoryError (an
// OutOfMemoryError) when the lowest failing rank threw an OutOfMemoryError, so that a program that
// retries on it retries on every rank, else SharedError. The lowest failing rank's carries its own
// message; every other rank's names that rank and carries its message. Every rank leaves at the
// same point with an exception, and the world stays whole (no MPI_Abort): the command prints the
// message once, from rank 0, and every rank exits with status 2. What together() does not cover
// still ends the command's run on every rank, with MPI_Abort after the message, the launcher
// stopping the other ranks; in a program of one's own it leaves them waiting. In the Trainer that
// is: allocating the arenas and the optimizer's state when train() starts (before its budget is
// set: a device that another process fills), the boundary step, the running loss sum and the log
// line (where an asynchronous CUDA error surfaces), and ncclCommInitRank; in the Accelerator, a
// batch's copy to the device. Arguments and inputs that would lead the ranks' collectives apart
// are compared before they can (check_arguments_agree, check_ranks_agree in train/trainer.h).

#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "core/tensor.h"
#include "train/data.h"

namespace microbatch::train {

/// How the ranks' tensors are summed: Mpi (host memory), Nccl (CUDA device memory), or None for a
/// world of one.
enum class DdpBackend { None, Mpi, Nccl };
const char* ddp_backend_name(DdpBackend backend);

/// What every rank throws when together() learns that a rank failed (Note [Failing together]).
/// The failing rank's exception carries its own message, the others' name that rank and carry its
/// message. Every rank throws the same kind: SharedOutOfMemoryError (an OutOfMemoryError) when
/// the failing rank ran out of memory, else SharedError (an Error).
class SharedFailure {
 public:
  explicit SharedFailure(int failed_rank) : failed_rank_(failed_rank) {}
  virtual ~SharedFailure() = default;
  /// The lowest rank that failed.
  int failed_rank() const { return failed_rank_; }

 private:
  int failed_rank_;
};
class SharedError final : public Error, public SharedFailure {
 public:
  SharedError(const std::string& what, int failed_rank) : Error(what), SharedFailure(failed_rank) {}
};
class SharedOutOfMemoryError final : public OutOfMemoryError, public SharedFailure {
 public:
  SharedOutOfMemoryError(const std::string& what, std::size_t requested, int failed_rank)
      : OutOfMemoryError(what, requested), SharedFailure(failed_rank) {}
};

/// Whether this build can run worlds of more than one process (MPI).
bool mpi_built();

/// The size, rank and local rank the launcher gave this process, from its environment alone (no
/// MPI call): {1, 0, 0} without a launcher. Malformed values are an error naming the variable.
struct LaunchInfo {
  int size = 1;
  int rank = 0;
  int local_rank = 0;
};
LaunchInfo launch_info();

class ProcessGroup {
 public:
  /// The processes this one was launched with (Note [Data parallel]); made on the first call. A
  /// world of more than one in a build without MPI is an error.
  static ProcessGroup& world();
  /// A world of this process alone, whatever the launcher said: to train on one rank what the
  /// whole world trains together (a reference for a data-parallel run), or to keep a model apart.
  static ProcessGroup& solo();

  int size() const { return size_; }
  int rank() const { return rank_; }
  /// The rank among the processes on this machine: the CUDA device a rank trains on.
  int local_rank() const { return local_rank_; }
  bool is_main() const { return rank_ == 0; }

  /// Makes `backend` ready for tensors on `device` (NCCL: one communicator, on that device).
  /// Refuses a backend that cannot sum that device's memory, or one this build lacks.
  void use(DdpBackend backend, Device device);
  DdpBackend backend() const { return backend_; }

  /// Sums a contiguous tensor over the ranks, in place (f32, f64, f16, bf16, i64; on the CPU over
  /// MPI, which sums 16-bit tensors in f32 and rounds once; on CUDA over NCCL). Every rank must
  /// call it, with the same shape and dtype.
  void all_reduce_sum(Tensor& t);
  /// Sums a host value over the ranks (MPI; a world of one returns it).
  double all_reduce_sum(double value);
  std::int64_t all_reduce_sum(std::int64_t value);
  std::int64_t all_reduce_max(std::int64_t value);
  /// Every rank's `mine` (each as long as the others'), rank after rank (MPI; a world of one
  /// returns its own).
  std::vector<std::int64_t> all_gather(const std::vector<std::int64_t>& mine);
  /// Copies rank `root`'s bytes of a contiguous tensor into every rank's.
  void broadcast(Tensor& t, int root = 0);
  /// Copies rank `root`'s host array (a std::string, or a std::vector of plain values), however
  /// long, into every rank's `array` (resized to fit).
  template <class Array>
  requires std::is_trivially_copyable_v<typename Array::value_type>
  void broadcast(Array& array, int root) {
    array.resize(
        static_cast<std::size_t>(broadcast_size(static_cast<std::int64_t>(array.size()), root)));
    broadcast_bytes(array.data(), static_cast<std::int64_t>(array.size() * sizeof(array[0])), root);
  }
  void barrier();
  /// Runs `work` on this rank; in a world of more than one, every rank then learns whether it threw
  /// on any rank, and if it did, throws too (Note [Failing together]). A collective, and a
  /// barrier: every rank must call it, and `work` must call no collective (a rank that failed
  /// before one would leave the others waiting in it). `doing` names the work in the message the
  /// other ranks throw ("training step 3"). In a world of one it only runs `work`.
  template <class Work>
  void together(const std::string& doing, Work&& work) {
    if (size_ == 1) {
      work();
      return;
    }
    std::exception_ptr failure;
    try {
      work();
    } catch (...) {
      failure = std::current_exception();
    }
    settle(failure, doing);
  }
  /// Whether `error` is one every rank threw together, through together(): a SharedFailure, or the
  /// rank's own error when every rank failed at once. The command then ends each rank on its own.
  static bool shared(const std::exception_ptr& error);
  /// After an error on this rank: ends every rank of a world of more than one (MPI_Abort), which
  /// would otherwise wait for this one in their next collective. Does nothing in a world of one,
  /// or before the world was made.
  static void abort_if_distributed(int code);
  enum class Ending { Clean, AfterError };
  /// Ends this process's part in the world (its NCCL communicator, then MPI): call it once, at the
  /// end of a program that made the world; after it, no collective may run. The group's
  /// destructor does it at exit otherwise, after other static objects (the CUDA runtime's) may
  /// have gone. AfterError (a shared error ends the program) aborts the NCCL communicator rather
  /// than wait on the other ranks' part in its destruction.
  void finalize(Ending ending = Ending::Clean);

  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

 private:
  ProcessGroup() = default;
  /// The NCCL communicator (an ncclComm_t) for a tensor on a CUDA device, made current; refused
  /// without one on that device.
  void* device_comm(const Tensor& t, const char* doing);
  /// Rank `root`'s `n`, on every rank.
  std::int64_t broadcast_size(std::int64_t n, int root);
  /// Copies rank `root`'s `bytes` bytes at `data` into every rank's.
  void broadcast_bytes(void* data, std::int64_t bytes, int root);
  /// together()'s collective: when `mine` (this rank's error, or null) is set on every rank, each
  /// rethrows its own; when on some, every rank throws a SharedFailure.
  void settle(std::exception_ptr mine, const std::string& doing);
  struct Nccl;
  int size_ = 1;
  int rank_ = 0;
  int local_rank_ = 0;
  bool mpi_started_ = false;  // this process called MPI_Init, and finalizes it
  DdpBackend backend_ = DdpBackend::None;
  std::unique_ptr<Nccl> nccl_;
};

/// Where this rank trains when `device` was asked for: in a world of more than one a CUDA device
/// becomes cuda:(local rank), which must be present, or cuda:0 where CUDA_VISIBLE_DEVICES shows
/// the process one GPU of its own; anything else stays as asked.
Device rank_device(const ProcessGroup& group, Device device);

/// "auto" (or empty), "mpi" or "nccl" (Hugging Face's ddp_backend). Auto is None in a world of
/// one, else Nccl on CUDA and Mpi on the CPU.
DdpBackend parse_ddp_backend(const std::string& name, const ProcessGroup& group, Device device);

/// Whether a device asked for names its CUDA index (kept), or leaves it to the rank.
enum class DeviceIndex { Named, Default };
/// Readies a rank of `group` to train where `device` was asked: in a world of more than one, on
/// its own GPU (rank_device, unless the index was named) and with the backend `ddp_backend` names
/// made ready there (use). Returns where the rank trains; a world of one keeps `device`.
Device prepare_rank(ProcessGroup& group, Device device, DeviceIndex index,
                    const std::string& ddp_backend);

/// How many of `n` samples are rank `rank`'s in a world of `size`: positions rank, rank + size, ...
/// (the ranks' shares differ by at most one).
std::int64_t share_size(std::int64_t n, int rank, int size);

/// Rank `rank`'s share of a window's samples: its entries at positions rank, rank + size, ...
std::vector<std::int64_t> window_share(const std::vector<std::int64_t>& window, int rank, int size);

/// A rank's share of a dataset, by the same rule: example i is the base's rank + i * size. The base
/// must outlive it. Evaluation reads such a share on each rank and sums the losses.
class DatasetShard : public Dataset {
 public:
  DatasetShard(const Dataset& base, int rank, int size);
  std::int64_t size() const override { return share_size(base_.size(), rank_, size_); }
  Example get(std::int64_t index) const override;

 private:
  const Dataset& base_;
  int rank_;
  int size_;
};

}  // namespace microbatch::train
