// The tensor-core attention kernels (kernels/attention_tc.h) run on the CPU: one OS thread per
// CUDA thread, barriers for __syncthreads and for the warp-wide shuffles, ldmatrix loads and MMAs,
// each emulated as the PTX ISA documents it (Note [MMA fragments]); the MMA reads each lane's
// fragment registers by the documented layout, independently of how the kernels load them. The
// block bodies are the very code the GPU runs, so these cases check their tiling, masking, online
// softmax, prefetching, fragment loads and operand layouts against attention computed in f64 from
// the same 16-bit inputs; and, as compute-sanitizer's racecheck would, that every
// shared-memory access is ordered by the barriers (Note [Emulated racecheck]) and every 16-byte
// load aligned. They cannot check the hardware itself; the CUDA parity cases in
// test_cuda_attention.cpp and test_cuda_nn.cpp do that where a GPU is present.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "core/half.h"
#include "kernels/attention_tc.h"
#include "tests/core/harness.h"

using namespace microbatch;
namespace tc = microbatch::kernels::tc;
using kernels::HeadStrides;

namespace {

// The block's shared state: what one CUDA block shares, plus the exchange slots the emulated
// warp-wide operations pass values through.
struct EmulatedBlock {
  std::barrier<> block{tc::kTcThreads};
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  float lanes[tc::kTcWarps][32] = {};
  const std::uint16_t* rows[tc::kTcWarps][32] = {};
  tc::TcA a[tc::kTcWarps][32] = {};
  tc::TcB b[tc::kTcWarps][32] = {};
  std::vector<std::uint16_t> smem;
  // ldmatrix row addresses that were not 16-byte aligned within smem or did not lie in it, and the
  // byte offset of the first such (run_grid checks that there are none).
  std::atomic<int> bad_rows{0};
  std::atomic<std::int64_t> first_bad_row{0};
  // 16-byte global loads from an address that is not 16-byte aligned (run_grid checks that there
  // are none: the GPU would fault on one).
  std::atomic<int> bad_loads{0};
  // Note [Emulated racecheck]: per 16-bit word of shared memory, the last write and the reads
  // since, each tagged (epoch << 8) | (thread + 1), the epoch counting the block's barriers
  // (kManyReaders for reads by several threads in one epoch). An access by a thread in the epoch
  // of another thread's write, or a write in the epoch of another thread's read, is a hazard: the
  // barriers do not order the two. Each access publishes its own tag before it reads the other
  // kind (sequentially consistent atomics), so of two racing accesses at least one sees the other.
  static constexpr std::uint32_t kManyReaders = 0xFF;
  std::vector<std::atomic<std::uint32_t>> written, read;
  std::atomic<int> hazards{0};
  std::atomic<std::int64_t> first_hazard{-1};  // its byte offset in shared memory

  explicit EmulatedBlock(int shared_halves)
      : smem(shared_halves, 0xffff), written(shared_halves), read(shared_halves) {
    for (int w = 0; w < tc::kTcWarps; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
  }
};

template <class T>
float half_of(std::uint32_t reg, int which) {
  T x;
  x.bits = static_cast<std::uint16_t>(reg >> (16 * which));
  return static_cast<float>(x);
}

// One CUDA thread of an EmulatedBlock (the Ctx of kernels/attention_tc.h).
class EmulatedThread {
 public:
  EmulatedThread(EmulatedBlock* block, int thread) : block_(block), thread_(thread) {}

  int thread() const { return thread_; }
  void sync() {
    block_->block.arrive_and_wait();
    ++epoch_;
  }

  float shfl_xor(float v, int mask) {
    block_->lanes[warp()][lane()] = v;
    warp_sync();
    const float r = block_->lanes[warp()][lane() ^ mask];
    warp_sync();
    return r;
  }

  // Register i of lane l: elements (l / 4, 2 (l % 4) + {0, 1}) of matrix i, whose row r lane
  // 8 i + r points at; with kTrans, elements (2 (l % 4) + {0, 1}, l / 4).
  template <bool kTrans>
  void ldmatrix(std::uint32_t (&r)[4], const std::uint16_t* row) {
    check_row(row);
    for (int k = 0; k < 8; ++k) shared_read(row + k);
    block_->rows[warp()][lane()] = row;
    warp_sync();
    const int l = lane();
    for (int i = 0; i < 4; ++i) {
      const std::uint16_t* const* matrix = &block_->rows[warp()][8 * i];
      const std::uint16_t lo = kTrans ? matrix[2 * (l % 4)][l / 4] : matrix[l / 4][2 * (l % 4)];
      const std::uint16_t hi =
          kTrans ? matrix[2 * (l % 4) + 1][l / 4] : matrix[l / 4][2 * (l % 4) + 1];
      r[i] = tc::pack_pair(lo, hi);
    }
    warp_sync();
  }

  void store_shared16(std::uint16_t* p, const std::uint32_t (&w)[4]) {
    for (int k = 0; k < 8; ++k) shared_write(p + k);
    std::memcpy(p, w, 16);
  }
  void store_shared(float* p, float v) {
    const auto* words = reinterpret_cast<const std::uint16_t*>(p);
    shared_write(words);
    shared_write(words + 1);
    std::memcpy(p, &v, 4);
  }
  float load_shared(const float* p) {
    const auto* words = reinterpret_cast<const std::uint16_t*>(p);
    shared_read(words);
    shared_read(words + 1);
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }

  void load16(std::uint32_t (&w)[4], const void* p) {
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) block_->bad_loads.fetch_add(1);
    std::memcpy(w, p, 16);
  }

  template <class T>
  void mma(tc::TcAcc& c, const tc::TcA& a, const tc::TcB& b) {
    block_->a[warp()][lane()] = a;
    block_->b[warp()][lane()] = b;
    warp_sync();
    const int g = lane() >> 2, t = lane() & 3;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += a_at<T>(row, k) * b_at<T>(k, col);
      c.x[e] += sum;
    }
    warp_sync();
  }

 private:
  int warp() const { return thread_ >> 5; }
  int lane() const { return thread_ & 31; }
  void warp_sync() { block_->warps[warp()]->arrive_and_wait(); }

  // An ldmatrix row is 16 bytes of shared memory that four lanes load together: its address must
  // be 16-byte aligned (PTX ISA, ldmatrix; the GPU's shared array is __align__(16), so the offset
  // from its start decides) and the row must lie within the block's shared memory.
  void check_row(const std::uint16_t* row) {
    const std::int64_t offset = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(row) -
                                                          reinterpret_cast<std::uintptr_t>(
                                                              block_->smem.data()));
    const std::int64_t bytes = static_cast<std::int64_t>(block_->smem.size()) * 2;
    if (offset % 16 == 0 && offset >= 0 && offset + 16 <= bytes) return;
    if (block_->bad_rows.fetch_add(1) == 0) block_->first_bad_row = offset;
  }

  // A[row][k]: lane 4 * (row % 8) + (k % 8) / 2, register (row >= 8) + 2 * (k >= 8), half k % 2.
  template <class T>
  float a_at(int row, int k) const {
    const int holder = 4 * (row % 8) + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return half_of<T>(block_->a[warp()][holder].r[reg], k % 2);
  }
  // B[k][n]: lane 4 * n + (k % 8) / 2, register k >= 8, half k % 2.
  template <class T>
  float b_at(int k, int n) const {
    const int holder = 4 * n + (k % 8) / 2;
    return half_of<T>(block_->b[warp()][holder].r[k >= 8 ? 1 : 0], k % 2);
  }

  // Note [Emulated racecheck].
  std::uint32_t tag() const { return (epoch_ << 8) | static_cast<std::uint32_t>(thread_ + 1); }
  std::size_t word_of(const std::uint16_t* p) const {
    const auto index = p - block_->smem.data();
    if (index < 0 || index >= static_cast<std::ptrdiff_t>(block_->smem.size())) {
      // Outside shared memory: counted as a hazard at a negative offset.
      hazard(-1);
      return block_->smem.size();
    }
    return static_cast<std::size_t>(index);
  }
  void hazard(std::int64_t word) const {
    if (block_->hazards.fetch_add(1) == 0) block_->first_hazard = 2 * word;
  }
  // Whether `other`, a tag of this epoch, is another thread's.
  bool foreign(std::uint32_t other) const {
    return other != 0 && (other >> 8) == epoch_ &&
           (other & 0xFF) != static_cast<std::uint32_t>(thread_ + 1);
  }
  void shared_read(const std::uint16_t* p) {
    const std::size_t w = word_of(p);
    if (w == block_->smem.size()) return;
    std::atomic<std::uint32_t>& readers = block_->read[w];
    std::uint32_t seen = readers.load();
    for (;;) {
      std::uint32_t next = tag();
      if (seen != 0 && (seen >> 8) == epoch_ && seen != tag())
        next = (epoch_ << 8) | EmulatedBlock::kManyReaders;
      if (seen == next || readers.compare_exchange_weak(seen, next)) break;
    }
    if (foreign(block_->written[w].load())) hazard(static_cast<std::int64_t>(w));
  }
  void shared_write(const std::uint16_t* p) {
    const std::size_t w = word_of(p);
    if (w == block_->smem.size()) return;
    const std::uint32_t before = block_->written[w].exchange(tag());
    if (foreign(before) || foreign(block_->read[w].load())) hazard(static_cast<std::int64_t>(w));
  }

  EmulatedBlock* block_;
  int thread_;
  std::uint32_t epoch_ = 0;  // barriers passed
};

// Runs body(ctx, smem) on one block of 128 threads over `halves` words of shared memory; returns
// the hazards the emulation saw (Note [Emulated racecheck]).
template <class Body>
int block_hazards(int halves, Body body) {
  EmulatedBlock shared(halves);
  std::vector<std::thread> threads;
  for (int i = 0; i < tc::kTcThreads; ++i) {
    threads.emplace_back([&, i] {
      EmulatedThread ctx(&shared, i);
      body(ctx, shared.smem.data());
    });
  }
  for (std::thread& th : threads) th.join();
  return shared.hazards.load();
}

// Runs body(ctx, block, smem) for every block of the grid, 128 threads at a time.
template <int kD, int kM, class Body>
void run_grid(std::int64_t blocks, Body body) {
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    EmulatedBlock shared(tc::TcGeometry<kD, kM>::kSharedHalves);
    std::vector<std::thread> threads;
    for (int i = 0; i < tc::kTcThreads; ++i) {
      threads.emplace_back([&, i] {
        EmulatedThread ctx(&shared, i);
        body(ctx, blk, shared.smem.data());
      });
    }
    for (std::thread& th : threads) th.join();
    INFO("block " << blk << ": " << shared.bad_rows.load()
                  << " ldmatrix rows misaligned or outside shared memory, the first at byte offset "
                  << shared.first_bad_row.load());
    REQUIRE(shared.bad_rows.load() == 0);
    INFO("block " << blk << ": " << shared.bad_loads.load() << " misaligned 16-byte global loads");
    REQUIRE(shared.bad_loads.load() == 0);
    INFO("block " << blk << ": " << shared.hazards.load()
                  << " shared-memory accesses no barrier orders, the first at byte offset "
                  << shared.first_hazard.load());
    REQUIRE(shared.hazards.load() == 0);
  }
}

// One head layout: (B, H, rows, D) contiguous, or (B, rows, H, D) read as (B, H, rows, D).
struct Layout {
  std::int64_t b, h, rows, d;
  bool heads_inner;
  std::int64_t size() const { return b * h * rows * d; }
  HeadStrides strides() const {
    if (heads_inner) return {h, rows * h * d, d, h * d};
    return {h, h * rows * d, rows * d, d};
  }
  std::int64_t at(std::int64_t bh, std::int64_t r, std::int64_t c) const {
    return kernels::head_offset(strides(), bh) + r * strides().row + c;
  }
};

struct Case {
  std::int64_t b, h, t, s, d;
  bool causal;
  bool heads_inner = false;
};

template <class T>
std::vector<T> random_values(std::int64_t n, std::uint32_t seed, float lo, float hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<T> out(n);
  for (T& x : out) x = T(dist(gen));
  return out;
}

double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// Checks |got - want| <= tol * (max |want| + |want|) everywhere: a wrong row, column or mask
// shows up as an error of the order of max |want|.
template <class T>
void check_against(const char* what, const std::vector<T>& got, const std::vector<double>& want,
                   double tol) {
  REQUIRE(got.size() == want.size());
  const double scale = max_abs(want);
  double worst = 0.0;
  std::size_t worst_at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(static_cast<float>(got[i])) - want[i]) /
                       (scale + std::abs(want[i]));
    if (err > worst || std::isnan(err)) {
      worst = std::isnan(err) ? INFINITY : err;
      worst_at = i;
    }
  }
  INFO(what << ": worst relative error " << worst << " at " << worst_at << " (got "
            << static_cast<float>(got[worst_at]) << ", want " << want[worst_at] << ")");
  CHECK(worst <= tol);
}

// Runs the three bodies with kM row tiles per warp on case c and checks them against f64.
template <class T, int kD, int kM>
void check_case(const Case& c, double tol) {
  CAPTURE(c.b);
  CAPTURE(c.h);
  CAPTURE(c.t);
  CAPTURE(c.s);
  CAPTURE(c.d);
  CAPTURE(c.causal);
  CAPTURE(c.heads_inner);
  CAPTURE(kM);
  const Layout ql{c.b, c.h, c.t, c.d, c.heads_inner}, kl{c.b, c.h, c.s, c.d, c.heads_inner};
  const std::vector<T> q = random_values<T>(ql.size(), 1, -2.0f, 2.0f);
  const std::vector<T> k = random_values<T>(kl.size(), 2, -2.0f, 2.0f);
  const std::vector<T> v = random_values<T>(kl.size(), 3, -1.0f, 1.0f);
  const std::vector<T> dout = random_values<T>(ql.size(), 4, -1.0f, 1.0f);  // laid out as q
  const std::int64_t heads = c.b * c.h;
  constexpr std::int64_t kRows = tc::TcGeometry<kD, kM>::kBlockRows;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  // The launch's own rule (tc::vector_rows), on these buffers' addresses.
  auto vec = [&](const std::vector<T>& x, const Layout& l) {
    return tc::vector_rows(x.data(), l.strides(), l.d, kD);
  };

  tc::TcOperands<T> p{kernels::AttentionOperands<T>{.q = q.data(),
                                                   .k = k.data(),
                                                   .v = v.data(),
                                                   .qs = ql.strides(),
                                                   .ks = kl.strides(),
                                                   .vs = kl.strides(),
                                                   .t = c.t,
                                                   .s = c.s,
                                                   .d = c.d,
                                                   .scale = static_cast<float>(scale),
                                                   .causal = c.causal}};
  // The outputs lie as the inputs do (Note [Attention outputs where the inputs lie]): out and dq
  // as q, dk and dv as k and v.
  p.os = p.dqs = ql.strides();
  p.dks = p.dvs = kl.strides();
  p.dout = dout.data();
  p.dos = ql.strides();
  p.vec_q = vec(q, ql);
  p.vec_dout = vec(dout, ql);
  p.vec_k = vec(k, kl);
  p.vec_v = vec(v, kl);
  p.tiles = (c.t + kRows - 1) / kRows;

  // Forward: out laid out as q, lse contiguous (B * H, T).
  std::vector<T> out(ql.size(), T(-7.0f));
  std::vector<float> lse(heads * c.t, -7.0f);
  run_grid<kD, kM>(heads * p.tiles, [&](EmulatedThread& ctx, std::int64_t blk, std::uint16_t* smem) {
    tc::tc_forward_block<T, kD, kM>(ctx, p, out.data(), lse.data(), blk, smem);
  });

  // The reference, in f64 from the same 16-bit values.
  auto val = [](const std::vector<T>& x, std::int64_t i) {
    return static_cast<double>(static_cast<float>(x[i]));
  };
  std::vector<double> out_ref(heads * c.t * c.d), lse_ref(lse.size()), dq_ref(out_ref.size(), 0.0),
      dk_ref(heads * c.s * c.d, 0.0), dv_ref(heads * c.s * c.d, 0.0);
  for (std::int64_t bh = 0; bh < heads; ++bh) {
    for (std::int64_t i = 0; i < c.t; ++i) {
      std::vector<double> w(c.s, 0.0), dp(c.s, 0.0);
      double mx = -INFINITY;
      for (std::int64_t j = 0; j < c.s; ++j) {
        if (c.causal && j > i) continue;
        double dot = 0.0;
        for (std::int64_t x = 0; x < c.d; ++x)
          dot += val(q, ql.at(bh, i, x)) * val(k, kl.at(bh, j, x));
        w[j] = dot * scale;
        mx = std::max(mx, w[j]);
      }
      double total = 0.0;
      for (std::int64_t j = 0; j < c.s; ++j) {
        w[j] = (c.causal && j > i) ? 0.0 : std::exp(w[j] - mx);
        total += w[j];
      }
      lse_ref[bh * c.t + i] = mx + std::log(total);
      double delta = 0.0;
      for (std::int64_t x = 0; x < c.d; ++x) {
        double o = 0.0;
        for (std::int64_t j = 0; j < c.s; ++j) o += w[j] / total * val(v, kl.at(bh, j, x));
        out_ref[(bh * c.t + i) * c.d + x] = o;
        delta += o * val(dout, ql.at(bh, i, x));
      }
      for (std::int64_t j = 0; j < c.s; ++j) {
        const double pij = w[j] / total;
        if (pij == 0.0) continue;
        double dpij = 0.0;
        for (std::int64_t x = 0; x < c.d; ++x)
          dpij += val(dout, ql.at(bh, i, x)) * val(v, kl.at(bh, j, x));
        const double ds = pij * (dpij - delta);
        for (std::int64_t x = 0; x < c.d; ++x) {
          dv_ref[(bh * c.s + j) * c.d + x] += pij * val(dout, ql.at(bh, i, x));
          dk_ref[(bh * c.s + j) * c.d + x] += scale * ds * val(q, ql.at(bh, i, x));
          dq_ref[(bh * c.t + i) * c.d + x] += scale * ds * val(k, kl.at(bh, j, x));
        }
      }
    }
  }
  // The outputs gathered into contiguous (B * H, rows, D), as the references are.
  auto gathered = [](const std::vector<T>& x, const Layout& l) {
    std::vector<T> g(x.size());
    for (std::int64_t bh = 0; bh < l.b * l.h; ++bh)
      for (std::int64_t r = 0; r < l.rows; ++r)
        for (std::int64_t c = 0; c < l.d; ++c) g[(bh * l.rows + r) * l.d + c] = x[l.at(bh, r, c)];
    return g;
  };
  check_against("out", gathered(out, ql), out_ref, tol);
  double lse_err = 0.0;
  for (std::size_t i = 0; i < lse.size(); ++i)
    lse_err = std::max(lse_err, std::abs(lse[i] - lse_ref[i]) / (1.0 + std::abs(lse_ref[i])));
  INFO("lse: worst relative error " << lse_err);
  CHECK(lse_err <= 1e-5);

  // Backward, from the kernels' own out and lse, delta as the delta kernel computes it.
  std::vector<float> delta(heads * c.t);
  for (std::int64_t bh = 0; bh < heads; ++bh) {
    for (std::int64_t i = 0; i < c.t; ++i) {
      float acc = 0.0f;
      for (std::int64_t x = 0; x < c.d; ++x)
        acc += static_cast<float>(out[ql.at(bh, i, x)]) * static_cast<float>(dout[ql.at(bh, i, x)]);
      delta[bh * c.t + i] = acc;
    }
  }
  std::vector<T> dq(ql.size(), T(-7.0f)), dk(kl.size(), T(-7.0f)), dv(kl.size(), T(-7.0f));
  tc::TcOperands<T> kp = p;
  kp.tiles = (c.s + kRows - 1) / kRows;
  run_grid<kD, kM>(heads * kp.tiles, [&](EmulatedThread& ctx, std::int64_t blk, std::uint16_t* smem) {
    tc::tc_dkdv_block<T, kD, kM>(ctx, kp, lse.data(), delta.data(), dk.data(), dv.data(), blk, smem);
  });
  run_grid<kD, kM>(heads * p.tiles, [&](EmulatedThread& ctx, std::int64_t blk, std::uint16_t* smem) {
    tc::tc_dq_block<T, kD, kM>(ctx, p, lse.data(), delta.data(), dq.data(), blk, smem);
  });
  check_against("dv", gathered(dv, kl), dv_ref, tol);
  check_against("dk", gathered(dk, kl), dk_ref, tol);
  check_against("dq", gathered(dq, ql), dq_ref, tol);
}

// Rounding P and dS to 16 bits before their MMAs, and the 16-bit outputs, bound the error: the
// worst seen is 3.1e-3 in bf16 and 6e-4 in f16, about a third of these.
constexpr double kTolF16 = 2e-3;
constexpr double kTolBf16 = 1e-2;

}  // namespace

TEST_CASE("the emulation's racecheck sees what no barrier orders, and only that") {
  // Each thread writes its own 16 bytes, then reads its neighbour's f32: ordered by a barrier, or
  // not; a write over what another thread read in the same epoch; a thread's own words.
  const int halves = tc::kTcThreads * 8;
  const std::uint32_t words[4] = {1, 2, 3, 4};
  auto neighbour = [](EmulatedThread& ctx, std::uint16_t* smem) {
    return reinterpret_cast<const float*>(smem + 8 * ((ctx.thread() + 1) % tc::kTcThreads));
  };
  CHECK(block_hazards(halves, [&](EmulatedThread& ctx, std::uint16_t* smem) {
          ctx.store_shared16(smem + 8 * ctx.thread(), words);
          ctx.sync();
          ctx.load_shared(neighbour(ctx, smem));
        }) == 0);
  CHECK(block_hazards(halves, [&](EmulatedThread& ctx, std::uint16_t* smem) {
          ctx.store_shared16(smem + 8 * ctx.thread(), words);
          ctx.load_shared(neighbour(ctx, smem));  // no barrier: read after another's write
        }) > 0);
  CHECK(block_hazards(halves, [&](EmulatedThread& ctx, std::uint16_t* smem) {
          ctx.store_shared16(smem + 8 * ctx.thread(), words);
          ctx.sync();
          ctx.load_shared(neighbour(ctx, smem));
          ctx.store_shared16(smem + 8 * ctx.thread(), words);  // over what a neighbour reads
        }) > 0);
  CHECK(block_hazards(halves, [&](EmulatedThread& ctx, std::uint16_t* smem) {
          auto* own = reinterpret_cast<float*>(smem + 8 * ctx.thread());
          ctx.store_shared(own, 1.0f);
          ctx.load_shared(own);
          ctx.store_shared(own, 2.0f);  // a thread's own words need no barrier
        }) == 0);
}

TEST_CASE("tensor-core attention, emulated on the CPU: tiles, masks and layouts at D = 64") {
  for (const Case& c : {Case{1, 1, 200, 200, 64, true},      // full and partial block tiles
                        Case{1, 2, 80, 80, 64, false},
                        Case{2, 1, 20, 70, 64, true},        // T < S
                        Case{1, 1, 70, 20, 64, true},        // T > S: queries past S
                        Case{1, 2, 1, 33, 64, false},        // T = 1
                        Case{2, 3, 65, 65, 64, true, true},  // (B, T, H, D) read as (B, H, T, D)
                        Case{1, 1, 40, 40, 40, true}}) {     // D padded to 64, scalar loads
    check_case<bf16, 64, 1>(c, kTolBf16);
    check_case<bf16, 64, 2>(c, kTolBf16);
  }
  check_case<f16, 64, 1>(Case{1, 2, 80, 80, 64, true}, kTolF16);
  check_case<f16, 64, 2>(Case{1, 2, 80, 80, 64, true}, kTolF16);
}

TEST_CASE("tensor-core attention, emulated on the CPU: D = 128 and D = 32 geometries") {
  check_case<bf16, 128, 1>(Case{1, 1, 40, 40, 128, true}, kTolBf16);
  check_case<bf16, 128, 1>(Case{2, 2, 21, 21, 128, true, true}, kTolBf16);  // heads inner
  check_case<f16, 128, 1>(Case{1, 1, 33, 20, 100, false}, kTolF16);
  check_case<bf16, 32, 1>(Case{1, 2, 70, 70, 32, true}, kTolBf16);
  check_case<bf16, 32, 2>(Case{1, 2, 70, 70, 32, true}, kTolBf16);
  check_case<f16, 32, 2>(Case{2, 1, 9, 9, 1, true}, kTolF16);  // D = 1
  // Long enough for tiles wholly below the diagonal, which skip the per-element mask.
  check_case<bf16, 128, 1>(Case{1, 1, 200, 200, 128, true}, kTolBf16);
  check_case<bf16, 32, 2>(Case{1, 1, 200, 200, 32, true}, kTolBf16);
}

TEST_CASE("attention tiles: 16-byte row loads only where every row starts on a 16-byte boundary") {
  alignas(16) static std::uint16_t buffer[64];
  const void* aligned = buffer;
  const void* off_by_one = buffer + 1;  // 2 bytes past a boundary
  // GPT-2's q, k and v: (B, T, 3C) with C = 12 * 64, heads of 64 inside a row, at offsets 0, C, 2C.
  const HeadStrides gpt{.heads = 12, .batch = 1024 * 2304, .head = 64, .row = 2304};
  CHECK(tc::vector_rows(aligned, gpt, 64, 64));
  const auto k_view =
      reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(buffer) + 768 * 2);
  CHECK(tc::vector_rows(k_view, gpt, 64, 64));  // the k view: 768 elements on
  CHECK_FALSE(tc::vector_rows(off_by_one, gpt, 64, 64));
  CHECK_FALSE(tc::vector_rows(aligned, gpt, 40, 64));  // rows shorter than the tile: zero padded
  CHECK_FALSE(tc::vector_rows(aligned, {.heads = 2, .batch = 2 * 7 * 60, .head = 60, .row = 120},
                              64, 64));                           // d = 60 heads inside rows
  CHECK_FALSE(tc::vector_rows(aligned, {.heads = 1, .batch = 3 * 68, .row = 68}, 64, 64));
  CHECK_FALSE(
      tc::vector_rows(aligned, {.heads = 3, .batch = 1, .head = 3 * 64, .row = 64}, 64, 64));
  CHECK(tc::vector_rows(aligned, {.heads = 3, .batch = 3 * 9 * 32, .head = 9 * 32, .row = 32},
                        32, 32));
}

TEST_CASE("attention tiles: under a causal mask each head's blocks take the longest walks first") {
  // Query tile i walks the keys below (i + 1) rows (forward, dq); key tile j the queries from its
  // first row on (dk, dv). Numbered as the grid starts them, each head's walks only shorten.
  constexpr std::int64_t rows = 64, tiles = 5, t = rows * tiles;
  for (std::int64_t head = 0; head < 3; ++head) {
    std::int64_t last_queries = t + 1, last_keys = t + 1;
    for (std::int64_t k = 0; k < tiles; ++k) {
      const std::int64_t block = head * tiles + k;
      const std::int64_t i = tc::tile_of(block, tiles, tc::TileOrder::LastFirst);
      const std::int64_t j = tc::tile_of(block, tiles, tc::TileOrder::FirstFirst);
      const std::int64_t keys_walked = (i + 1) * rows, queries_walked = t - j * rows;
      CHECK(keys_walked < last_keys);
      CHECK(queries_walked < last_queries);
      last_keys = keys_walked;
      last_queries = queries_walked;
    }
  }
}

TEST_CASE("attention tiles: sees_all holds exactly when every pair of the tile is visible") {
  // The kernels skip the per-element mask on tiles sees_all() accepts; it must never accept a
  // tile with a masked or out-of-range pair, and it accepts the tiles below the diagonal.
  for (bool causal : {true, false}) {
    for (std::int64_t t : {1, 7, 64, 70}) {
      for (std::int64_t s : {1, 9, 64, 70}) {
        const kernels::AttentionOperands<bf16> p{.t = t, .s = s, .d = 64, .scale = 1.0f, .causal = causal};
        for (std::int64_t rows : {16, 32}) {
          for (std::int64_t cols : {16, 64}) {
            for (std::int64_t i0 = 0; i0 < t + rows; i0 += 8) {
              for (std::int64_t j0 = 0; j0 < s + cols; j0 += 8) {
                bool all = true;
                for (std::int64_t i = i0; i < i0 + rows; ++i)
                  for (std::int64_t j = j0; j < j0 + cols; ++j) all = all && p.visible(i, j);
                CAPTURE(causal);
                CAPTURE(t);
                CAPTURE(s);
                CAPTURE(i0);
                CAPTURE(j0);
                CHECK(p.sees_all(i0, rows, j0, cols) == all);
              }
            }
          }
        }
      }
    }
  }
}
