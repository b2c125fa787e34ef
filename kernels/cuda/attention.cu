// CUDA fused scaled-dot-product attention (kernels/attention.h): f32 math on shared-memory tiles.
// The forward keeps, per query, a running max m, a running sum l of exp(score - m) and an output
// accumulator rescaled whenever m grows (online softmax), and stores out = acc / l and
// lse = m + log(l). The backward recomputes each score tile from q, k and lse. Every output
// element (out, lse, delta, dq, dk, dv) is overwritten by exactly one thread, and every sum runs
// in a fixed order: no atomics, the same bits on every run.
//
// Note [Attention tiles]: a block of kWarps warps works on one head. Forward and dq: the block
// owns kRows = kWarps * kPerWarp queries, kPerWarp per warp, and walks the keys in tiles of 32,
// lane j taking key j of the tile. Lane j computes its key's scores against the warp's queries
// (their rows are read from shared memory by the whole warp at once, a broadcast); the warp
// reduces them for the softmax; then the accumulators, split along D over the lanes (kMaxD / 32
// columns each), add p_j * v_j for j = 0..31 in order, p_j broadcast from lane j by a shuffle.
// The dk/dv kernel is the transpose: the block owns kRows keys and walks the queries in tiles of
// 32, lane i taking query i. Tiles read one row per lane are stored with a row stride of kMaxD + 1
// floats, so that the 32 lanes hit 32 different banks. Heads are padded with zeros to kMaxD (32,
// 64 or 128); 128-wide heads give each warp 2 rows instead of 4 so that every kernel's static
// shared memory stays under 48 KiB.
//
// f16 and bf16 take the tensor-core kernels of kernels/attention_tc.h instead (Note [Tensor-core
// attention]); MB_ATTENTION_KERNEL=simt sends them here too. f32 always runs here: its GEMMs do
// not use TF32 either.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/attention_tc.h"
#include "kernels/cuda/common.cuh"

namespace microbatch::kernels::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kBlockThreads = kWarps * 32;
constexpr int kTile = 32;  // keys (forward, dq) or queries (dk/dv) per tile: one per lane
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <int kMaxD>
struct Geometry {
  static_assert(kMaxD % 32 == 0 && kMaxD <= kAttentionMaxHeadDim);
  static constexpr int kPerWarp = kMaxD == 128 ? 2 : 4;  // rows a warp owns
  static constexpr int kRows = kWarps * kPerWarp;        // rows a block owns
  static constexpr int kLaneCols = kMaxD / 32;           // accumulator columns per lane
  static constexpr int kPad = kMaxD + 1;                 // row stride of one-row-per-lane tiles
};

// tile[r * stride + c] = element c of row first + r of src, in f32, for r < tile_rows and
// c < kMaxD; zero past `rows` or `d`, so that dot products over kMaxD equal those over d.
// Consecutive threads read consecutive elements of a row.
template <int kMaxD, class T>
__device__ __forceinline__ void load_tile(float* tile, int stride, int tile_rows, const T* src,
                                          std::int64_t row_stride, std::int64_t first,
                                          std::int64_t rows, std::int64_t d) {
  for (int idx = threadIdx.x; idx < tile_rows * kMaxD; idx += blockDim.x) {
    const int r = idx / kMaxD, c = idx % kMaxD;
    const std::int64_t row = first + r;
    tile[r * stride + c] =
        (row < rows && c < d) ? static_cast<float>(src[row * row_stride + c]) : 0.0f;
  }
}

// ---- forward -----------------------------------------------------------------------------------

// Block b: head b / q_tiles, queries from (b % q_tiles) * kRows (Note [Attention tiles]).
template <class T, int kMaxD>
__global__ void __launch_bounds__(kBlockThreads)
    attention_forward_kernel(AttentionOperands<T> p, T* out, float* lse, std::int64_t q_tiles) {
  using G = Geometry<kMaxD>;
  constexpr int R = G::kPerWarp, L = G::kLaneCols;
  __shared__ float q_s[G::kRows * kMaxD];  // the block's queries, broadcast to a warp
  __shared__ float k_s[kTile * G::kPad];   // key j for lane j
  __shared__ float v_s[kTile * kMaxD];     // read along D by the lanes
  const std::int64_t bh = blockIdx.x / q_tiles;
  const std::int64_t i0 = (blockIdx.x % q_tiles) * G::kRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* k = p.k + head_offset(p.ks, bh);
  const T* v = p.v + head_offset(p.vs, bh);
  load_tile<kMaxD>(q_s, kMaxD, G::kRows, p.q + head_offset(p.qs, bh), p.qs.row, i0, p.t, p.d);

  float m[R], l[R], acc[R][L];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < L; ++c) acc[r][c] = 0.0f;
  }
  // Causal: no query of this block sees a key past its last query.
  const std::int64_t key_end = p.causal ? std::min(p.s, i0 + G::kRows) : p.s;
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kTile) {
    __syncthreads();  // every warp is done with the previous tile
    load_tile<kMaxD>(k_s, G::kPad, kTile, k, p.ks.row, j0, p.s, p.d);
    load_tile<kMaxD>(v_s, kMaxD, kTile, v, p.vs.row, j0, p.s, p.d);
    __syncthreads();  // the tiles (and, on the first pass, q_s) are in place

    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.0f;
#pragma unroll 8
    for (int c = 0; c < kMaxD; ++c) {
      const float kc = k_s[lane * G::kPad + c];
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] += q_s[(warp * R + r) * kMaxD + c] * kc;
    }
    float pr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const std::int64_t i = i0 + warp * R + r;
      const float sr = p.visible(i, j0 + lane) ? s[r] * p.scale : kNegInf;
      const float m_new = max_nan(m[r], warp_max(sr));
      // m_new stays -inf while every key so far is masked: nothing to add, nothing to rescale.
      const bool none = m_new == kNegInf;
      pr[r] = none ? 0.0f : expf(sr - m_new);
      const float correction = none ? 1.0f : expf(m[r] - m_new);  // 0 on the first visible key
      l[r] = l[r] * correction + warp_sum(pr[r]);
      m[r] = m_new;
#pragma unroll
      for (int c = 0; c < L; ++c) acc[r][c] *= correction;
    }
#pragma unroll 4
    for (int jj = 0; jj < kTile; ++jj) {
      float vj[L];
#pragma unroll
      for (int c = 0; c < L; ++c) vj[c] = v_s[jj * kMaxD + lane + 32 * c];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float pj = __shfl_sync(kFullMask, pr[r], jj);
#pragma unroll
        for (int c = 0; c < L; ++c) acc[r][c] += pj * vj[c];
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const std::int64_t i = i0 + warp * R + r;
    if (i >= p.t) continue;
    // l > 0 whenever the query sees a key, which key 0 always is; guard all the same.
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    T* o = out + head_offset(p.os, bh) + i * p.os.row;
#pragma unroll
    for (int c = 0; c < L; ++c) {
      const int col = lane + 32 * c;
      if (col < p.d) o[col] = static_cast<T>(acc[r][c] * inv);
    }
    if (lane == 0) lse[bh * p.t + i] = l[r] > 0.0f ? m[r] + logf(l[r]) : kNegInf;
  }
}

// ---- backward ----------------------------------------------------------------------------------

// delta[row] = sum_c out[row, c] * dout[row, c] for the B * H * T rows, one warp per row.
template <class T>
__global__ void attention_delta_kernel(const T* out, HeadStrides os, const T* dout, HeadStrides dos,
                                       float* delta, std::int64_t rows, std::int64_t t,
                                       std::int64_t d) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = grid_threads() / 32;
  for (std::int64_t row = global_thread() / 32; row < rows; row += warps) {
    const T* o = out + head_offset(os, row / t) + (row % t) * os.row;
    const T* g = dout + head_offset(dos, row / t) + (row % t) * dos.row;
    float acc = 0.0f;
    for (std::int64_t c = lane; c < d; c += 32)
      acc += static_cast<float>(o[c]) * static_cast<float>(g[c]);
    acc = warp_sum(acc);
    if (lane == 0) delta[row] = acc;
  }
}

// Block b: head b / k_tiles, keys from (b % k_tiles) * kRows; walks the queries that see them.
// dv_j = sum_i p_ij dout_i, dk_j = scale * sum_i ds_ij q_i (Note [Attention tiles]).
template <class T, int kMaxD>
__global__ void __launch_bounds__(kBlockThreads)
    attention_dkdv_kernel(AttentionOperands<T> p, const T* dout, HeadStrides dos, const float* lse,
                          const float* delta, T* dk, T* dv, std::int64_t k_tiles) {
  using G = Geometry<kMaxD>;
  constexpr int R = G::kPerWarp, L = G::kLaneCols;
  __shared__ float k_s[G::kRows * kMaxD];  // the block's keys, broadcast to a warp
  __shared__ float v_s[G::kRows * kMaxD];
  __shared__ float q_s[kTile * G::kPad];  // query i for lane i, then read along D
  __shared__ float do_s[kTile * G::kPad];
  const std::int64_t bh = blockIdx.x / k_tiles;
  const std::int64_t j0 = (blockIdx.x % k_tiles) * G::kRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* q = p.q + head_offset(p.qs, bh);
  const T* g = dout + head_offset(dos, bh);
  load_tile<kMaxD>(k_s, kMaxD, G::kRows, p.k + head_offset(p.ks, bh), p.ks.row, j0, p.s, p.d);
  load_tile<kMaxD>(v_s, kMaxD, G::kRows, p.v + head_offset(p.vs, bh), p.vs.row, j0, p.s, p.d);

  float dk_acc[R][L], dv_acc[R][L];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < L; ++c) dk_acc[r][c] = dv_acc[r][c] = 0.0f;
  }
  // Causal: queries before the block's first key see none of its keys.
  const std::int64_t first = p.causal ? (j0 / kTile) * kTile : 0;
  for (std::int64_t i0 = first; i0 < p.t; i0 += kTile) {
    __syncthreads();  // every warp is done with the previous tile
    load_tile<kMaxD>(q_s, G::kPad, kTile, q, p.qs.row, i0, p.t, p.d);
    load_tile<kMaxD>(do_s, G::kPad, kTile, g, dos.row, i0, p.t, p.d);
    __syncthreads();  // the tiles (and, on the first pass, k_s and v_s) are in place

    const std::int64_t i = i0 + lane;
    const float lse_i = i < p.t ? lse[bh * p.t + i] : 0.0f;
    const float delta_i = i < p.t ? delta[bh * p.t + i] : 0.0f;
    float s[R], dp[R];  // scale-free score and dout_i . v_j for each of the warp's keys
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = dp[r] = 0.0f;
#pragma unroll 8
    for (int c = 0; c < kMaxD; ++c) {
      const float qc = q_s[lane * G::kPad + c], gc = do_s[lane * G::kPad + c];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        s[r] += qc * k_s[(warp * R + r) * kMaxD + c];
        dp[r] += gc * v_s[(warp * R + r) * kMaxD + c];
      }
    }
    float pr[R], ds[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool seen = p.visible(i, j0 + warp * R + r);
      pr[r] = seen ? expf(s[r] * p.scale - lse_i) : 0.0f;
      ds[r] = seen ? pr[r] * (dp[r] - delta_i) : 0.0f;
    }
#pragma unroll 4
    for (int ii = 0; ii < kTile; ++ii) {
      float qi[L], gi[L];
#pragma unroll
      for (int c = 0; c < L; ++c) {
        qi[c] = q_s[ii * G::kPad + lane + 32 * c];
        gi[c] = do_s[ii * G::kPad + lane + 32 * c];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float pj = __shfl_sync(kFullMask, pr[r], ii);
        const float dsj = __shfl_sync(kFullMask, ds[r], ii);
#pragma unroll
        for (int c = 0; c < L; ++c) {
          dv_acc[r][c] += pj * gi[c];
          dk_acc[r][c] += dsj * qi[c];
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const std::int64_t j = j0 + warp * R + r;
    if (j >= p.s) continue;
    T* dk_row = dk + head_offset(p.dks, bh) + j * p.dks.row;
    T* dv_row = dv + head_offset(p.dvs, bh) + j * p.dvs.row;
#pragma unroll
    for (int c = 0; c < L; ++c) {
      const int col = lane + 32 * c;
      if (col >= p.d) continue;
      dk_row[col] = static_cast<T>(dk_acc[r][c] * p.scale);
      dv_row[col] = static_cast<T>(dv_acc[r][c]);
    }
  }
}

// Block b: head b / q_tiles, queries from (b % q_tiles) * kRows; walks the keys they see.
// dq_i = scale * sum_j ds_ij k_j (Note [Attention tiles]).
template <class T, int kMaxD>
__global__ void __launch_bounds__(kBlockThreads)
    attention_dq_kernel(AttentionOperands<T> p, const T* dout, HeadStrides dos, const float* lse,
                        const float* delta, T* dq, std::int64_t q_tiles) {
  using G = Geometry<kMaxD>;
  constexpr int R = G::kPerWarp, L = G::kLaneCols;
  __shared__ float q_s[G::kRows * kMaxD];  // the block's queries, broadcast to a warp
  __shared__ float do_s[G::kRows * kMaxD];
  __shared__ float k_s[kTile * G::kPad];  // key j for lane j, then read along D
  __shared__ float v_s[kTile * G::kPad];
  const std::int64_t bh = blockIdx.x / q_tiles;
  const std::int64_t i0 = (blockIdx.x % q_tiles) * G::kRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* k = p.k + head_offset(p.ks, bh);
  const T* v = p.v + head_offset(p.vs, bh);
  load_tile<kMaxD>(q_s, kMaxD, G::kRows, p.q + head_offset(p.qs, bh), p.qs.row, i0, p.t, p.d);
  load_tile<kMaxD>(do_s, kMaxD, G::kRows, dout + head_offset(dos, bh), dos.row, i0, p.t, p.d);

  float lse_r[R], delta_r[R], dq_acc[R][L];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const std::int64_t i = i0 + warp * R + r;
    lse_r[r] = i < p.t ? lse[bh * p.t + i] : 0.0f;
    delta_r[r] = i < p.t ? delta[bh * p.t + i] : 0.0f;
#pragma unroll
    for (int c = 0; c < L; ++c) dq_acc[r][c] = 0.0f;
  }
  const std::int64_t key_end = p.causal ? std::min(p.s, i0 + G::kRows) : p.s;
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kTile) {
    __syncthreads();  // every warp is done with the previous tile
    load_tile<kMaxD>(k_s, G::kPad, kTile, k, p.ks.row, j0, p.s, p.d);
    load_tile<kMaxD>(v_s, G::kPad, kTile, v, p.vs.row, j0, p.s, p.d);
    __syncthreads();  // the tiles (and, on the first pass, q_s and do_s) are in place

    float s[R], dp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = dp[r] = 0.0f;
#pragma unroll 8
    for (int c = 0; c < kMaxD; ++c) {
      const float kc = k_s[lane * G::kPad + c], vc = v_s[lane * G::kPad + c];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        s[r] += q_s[(warp * R + r) * kMaxD + c] * kc;
        dp[r] += do_s[(warp * R + r) * kMaxD + c] * vc;
      }
    }
    float ds[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool seen = p.visible(i0 + warp * R + r, j0 + lane);
      ds[r] = seen ? expf(s[r] * p.scale - lse_r[r]) * (dp[r] - delta_r[r]) : 0.0f;
    }
#pragma unroll 4
    for (int jj = 0; jj < kTile; ++jj) {
      float kj[L];
#pragma unroll
      for (int c = 0; c < L; ++c) kj[c] = k_s[jj * G::kPad + lane + 32 * c];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float dsj = __shfl_sync(kFullMask, ds[r], jj);
#pragma unroll
        for (int c = 0; c < L; ++c) dq_acc[r][c] += dsj * kj[c];
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const std::int64_t i = i0 + warp * R + r;
    if (i >= p.t) continue;
    T* dq_row = dq + head_offset(p.dqs, bh) + i * p.dqs.row;
#pragma unroll
    for (int c = 0; c < L; ++c) {
      const int col = lane + 32 * c;
      if (col < p.d) dq_row[col] = static_cast<T>(dq_acc[r][c] * p.scale);
    }
  }
}

// ---- tensor-core kernels (f16, bf16) -----------------------------------------------------------

// The oldest architecture with the MMA shape below: Ampere (ldmatrix is Turing's). A build that
// also targets older ones compiles both for them as traps, which use_tensor_cores never reaches.
constexpr int kTcMinCapability = 80;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MB_TC_ARCH 0
#else
#define MB_TC_ARCH 1
#endif

// The execution context of kernels/attention_tc.h on the device.
struct DeviceContext {
  __device__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ void sync() const { __syncthreads(); }
  __device__ float shfl_xor(float v, int mask) const { return __shfl_xor_sync(kFullMask, v, mask); }
  template <bool kTrans>
  __device__ void ldmatrix(std::uint32_t (&r)[4], const std::uint16_t* row) const {
#if MB_TC_ARCH
    const auto address = static_cast<unsigned>(__cvta_generic_to_shared(row));
    // "memory": the asm reads shared memory that plain stores wrote before the barrier.
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(address)
                   : "memory");
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(address)
                   : "memory");
    }
#else
    __trap();
#endif
  }
  __device__ void store_shared16(std::uint16_t* p, const std::uint32_t (&w)[4]) const {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  __device__ void store_shared(float* p, float v) const { *p = v; }
  __device__ float load_shared(const float* p) const { return *p; }
  __device__ void load16(std::uint32_t (&w)[4], const void* p) const {
    const uint4 u = *static_cast<const uint4*>(p);
    w[0] = u.x;
    w[1] = u.y;
    w[2] = u.z;
    w[3] = u.w;
  }
  template <class T>
  __device__ void mma(tc::TcAcc& c, const tc::TcA& a, const tc::TcB& b) const {
#if !MB_TC_ARCH
    __trap();
#else
    if constexpr (std::is_same_v<T, bf16>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
    } else {
      static_assert(std::is_same_v<T, f16>);
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
    }
#endif
  }
};
#undef MB_TC_ARCH

template <class T, int kD>
__global__ void __launch_bounds__(tc::kTcThreads)
    tc_forward_kernel(tc::TcOperands<T> p, T* out, float* lse) {
  constexpr int kM = tc::kForwardTiles<kD>;
  __shared__ __align__(16) std::uint16_t smem[tc::TcGeometry<kD, kM>::kSharedHalves];
  DeviceContext ctx;
  tc::tc_forward_block<T, kD, kM>(ctx, p, out, lse, blockIdx.x, smem);
}

template <class T, int kD>
__global__ void __launch_bounds__(tc::kTcThreads)
    tc_dkdv_kernel(tc::TcOperands<T> p, const float* lse, const float* delta, T* dk, T* dv) {
  constexpr int kM = tc::kBackwardTiles;
  __shared__ __align__(16) std::uint16_t smem[tc::TcGeometry<kD, kM>::kSharedHalves];
  DeviceContext ctx;
  tc::tc_dkdv_block<T, kD, kM>(ctx, p, lse, delta, dk, dv, blockIdx.x, smem);
}

template <class T, int kD>
__global__ void __launch_bounds__(tc::kTcThreads)
    tc_dq_kernel(tc::TcOperands<T> p, const float* lse, const float* delta, T* dq) {
  constexpr int kM = tc::kBackwardTiles;
  __shared__ __align__(16) std::uint16_t smem[tc::TcGeometry<kD, kM>::kSharedHalves];
  DeviceContext ctx;
  tc::tc_dq_block<T, kD, kM>(ctx, p, lse, delta, dq, blockIdx.x, smem);
}

// ---- launch helpers ----------------------------------------------------------------------------

// Checks what the kernels assume of q, k and v (kernels/attention.h); returns the number of heads.
std::int64_t check_operands(const char* op, const StridedView& q, const StridedView& k,
                            const StridedView& v) {
  MB_CHECK(q.ndim == 3 || q.ndim == 4, "[{}] q must be (B, H, T, D) or (B, T, D), got {} dims", op,
           q.ndim);
  MB_CHECK(k.ndim == q.ndim && v.ndim == q.ndim, "[{}] q, k and v have {}, {} and {} dims", op,
           q.ndim, k.ndim, v.ndim);
  const int n = q.ndim;
  const std::int64_t t = q.shape[n - 2], s = k.shape[n - 2], d = q.shape[n - 1];
  MB_CHECK(d > 0 && d <= kAttentionMaxHeadDim,
           "[{}] head dim D = {} is outside the fused kernel's range 1..{}", op, d,
           kAttentionMaxHeadDim);
  MB_CHECK(k.shape[n - 1] == d && v.shape[n - 1] == d && v.shape[n - 2] == s,
           "[{}] k (.., {}, {}) and v (.., {}, {}) must be (.., S, D) with D = {}", op,
           k.shape[n - 2], k.shape[n - 1], v.shape[n - 2], v.shape[n - 1], d);
  for (int i = 0; i < n - 2; ++i) {
    MB_CHECK(k.shape[i] == q.shape[i] && v.shape[i] == q.shape[i],
             "[{}] batch and head dims differ at dim {}: q {}, k {}, v {}", op, i, q.shape[i],
             k.shape[i], v.shape[i]);
  }
  MB_CHECK(t > 0 && s > 0, "[{}] needs T > 0 and S > 0, got T = {}, S = {}", op, t, s);
  for (const StridedView* x : {&q, &k, &v}) {
    MB_CHECK(d == 1 || x->strides[n - 1] == 1, "[{}] q, k and v need unit stride along D, got {}",
             op, x->strides[n - 1]);
    MB_CHECK(x->dtype == q.dtype, "[{}] q, k and v dtypes differ: {} and {}", op,
             dtype_name(q.dtype), dtype_name(x->dtype));
  }
  return q.numel() / (t * d);
}

template <class T>
AttentionOperands<T> operands(const StridedView& q, const StridedView& k, const StridedView& v,
                              const StridedView& out, AttentionArgs args,
                              const StridedView* dq = nullptr, const StridedView* dk = nullptr,
                              const StridedView* dv = nullptr) {
  const int n = q.ndim;
  return {.q = q.ptr<T>(),
          .k = k.ptr<T>(),
          .v = v.ptr<T>(),
          .qs = head_strides(q),
          .ks = head_strides(k),
          .vs = head_strides(v),
          .os = head_strides(out),
          .dqs = dq != nullptr ? head_strides(*dq) : HeadStrides{},
          .dks = dk != nullptr ? head_strides(*dk) : HeadStrides{},
          .dvs = dv != nullptr ? head_strides(*dv) : HeadStrides{},
          .t = q.shape[n - 2],
          .s = k.shape[n - 2],
          .d = q.shape[n - 1],
          .scale = static_cast<float>(args.scale),
          .causal = args.causal};
}

// The kernel choice for f16 and bf16 (kernels/attention.h), read from the environment once.
AttentionKernel& kernel_choice() {
  static AttentionKernel choice = [] {
    const char* env = std::getenv("MB_ATTENTION_KERNEL");
    if (env == nullptr || *env == '\0' || std::strcmp(env, "tensor") == 0) {
      return AttentionKernel::tensor;
    }
    MB_CHECK(std::strcmp(env, "simt") == 0,
             "[attention] MB_ATTENTION_KERNEL must be 'tensor' or 'simt', got '{}'", env);
    return AttentionKernel::simt;
  }();
  return choice;
}

// Whether the tensor-core kernels run here: their mma.sync m16n8k16 needs code compiled for sm_80
// or later, which only such a device runs. A build for "75;90" has neither binary for an sm_86
// device, and the driver compiles the compute_75 code for it, where those bodies are traps: the
// PTX version of the kernel the driver loads for the device tells (cached per device).
bool tensor_cores_here() {
  static std::mutex mutex;
  static std::map<int, bool> by_device;
  int device = 0;
  MB_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  auto it = by_device.find(device);
  if (it == by_device.end()) {
    cudaFuncAttributes attr{};
    MB_CUDA_CHECK(cudaFuncGetAttributes(&attr, tc_forward_kernel<bf16, 64>));
    it = by_device.emplace(device, attr.ptxVersion >= kTcMinCapability).first;
  }
  return it->second;
}

// f16 and bf16 take the tensor-core kernels where they run, unless MB_ATTENTION_KERNEL=simt.
bool use_tensor_cores() {
  return kernel_choice() == AttentionKernel::tensor && tensor_cores_here();
}

// Whether view x can be copied to shared memory 16 bytes at a time (tc::vector_rows).
bool vector_rows(const StridedView& x, std::int64_t d, int kd) {
  return tc::vector_rows(x.data, head_strides(x), d, kd);
}

// The tensor-core kernels' operands: p, dout for the backward, which operands load 16 bytes at a
// time for head dim kd, and the tiles of block_rows rows that cover `rows` per head.
template <class T>
tc::TcOperands<T> tc_operands(const AttentionOperands<T>& p, const StridedView& q,
                              const StridedView& k, const StridedView& v, const StridedView* dout,
                              int kd, std::int64_t rows, int block_rows) {
  tc::TcOperands<T> tp{p};
  if (dout != nullptr) {
    tp.dout = dout->ptr<T>();
    tp.dos = head_strides(*dout);
    tp.vec_dout = vector_rows(*dout, p.d, kd);
  }
  tp.vec_q = vector_rows(q, p.d, kd);
  tp.vec_k = vector_rows(k, p.d, kd);
  tp.vec_v = vector_rows(v, p.d, kd);
  tp.tiles = ceil_div(rows, block_rows);
  return tp;
}

template <class F>
void dispatch_attention(DType dt, const char* op, F&& f) {
  switch (dt) {
    case DType::f32:
      return f.template operator()<float>();
    case DType::f16:
      return f.template operator()<f16>();
    case DType::bf16:
      return f.template operator()<bf16>();
    default:
      break;
  }
  MB_CHECK(false, "[{}] the fused kernel takes f32, f16 or bf16, got {}", op, dtype_name(dt));
}

// Calls f.template operator()<kMaxD>() with the smallest of 32, 64, 128 that holds d.
template <class F>
void with_head_dim(std::int64_t d, F&& f) {
  if (d <= 32) {
    f.template operator()<32>();
  } else if (d <= 64) {
    f.template operator()<64>();
  } else {
    f.template operator()<128>();
  }
}

unsigned tile_blocks(const char* op, std::int64_t heads, std::int64_t tiles) {
  const std::int64_t blocks = heads * tiles;
  MB_CHECK(blocks <= INT_MAX, "[{}] {} heads of {} tiles exceed one grid", op, heads, tiles);
  return static_cast<unsigned>(blocks);
}

// out, dq, dk and dv: like's shape and dtype, unit stride along D, any other strides (the op lays
// them out as q, k and v lie, Note [Attention outputs where the inputs lie] in
// core/ops/attention.cpp).
void check_rows(const char* op, const StridedView& x, const StridedView& like, DType dtype,
                const char* name) {
  bool same_shape = x.ndim == like.ndim;
  for (int i = 0; same_shape && i < x.ndim; ++i) same_shape = x.shape[i] == like.shape[i];
  const int n = x.ndim;
  MB_ASSERT(same_shape && x.dtype == dtype && (x.shape[n - 1] == 1 || x.strides[n - 1] == 1),
            "[{}] {} must be {} with the shape of its input and unit stride along D", op, name,
            dtype_name(dtype));
}

}  // namespace

AttentionKernel attention_kernel() { return kernel_choice(); }

bool tensor_core_attention_here() { return tensor_cores_here(); }

void set_attention_kernel(AttentionKernel kernel) { kernel_choice() = kernel; }

void attention_forward(const StridedView& q, const StridedView& k, const StridedView& v,
                       const StridedView& out, const StridedView& lse, AttentionArgs args) {
  constexpr const char* op = "attention_forward";
  const std::int64_t heads = check_operands(op, q, k, v);
  const std::int64_t t = q.shape[q.ndim - 2];
  check_rows(op, out, q, q.dtype, "out");
  MB_ASSERT(lse.is_contiguous() && lse.numel() == heads * t && lse.dtype == DType::f32,
            "[{}] lse must be contiguous f32 with {} elements", op, heads * t);
  dispatch_attention(q.dtype, op, [&]<class T>() {
    const AttentionOperands<T> p = operands<T>(q, k, v, out, args);
    with_head_dim(p.d, [&]<int kMaxD>() {
      if constexpr (!std::is_same_v<T, float>) {
        if (use_tensor_cores()) {
          constexpr int kRows = tc::TcGeometry<kMaxD, tc::kForwardTiles<kMaxD>>::kBlockRows;
          const tc::TcOperands<T> tp = tc_operands<T>(p, q, k, v, nullptr, kMaxD, p.t, kRows);
          tc_forward_kernel<T, kMaxD>
              <<<tile_blocks(op, heads, tp.tiles), tc::kTcThreads, 0, current_stream()>>>(
                  tp, out.ptr<T>(), lse.ptr<float>());
          MB_CUDA_CHECK_LAUNCH("tc_forward_kernel");
          return;
        }
      }
      const std::int64_t tiles = ceil_div(p.t, Geometry<kMaxD>::kRows);
      attention_forward_kernel<T, kMaxD>
          <<<tile_blocks(op, heads, tiles), kBlockThreads, 0, current_stream()>>>(
              p, out.ptr<T>(), lse.ptr<float>(), tiles);
      MB_CUDA_CHECK_LAUNCH("attention_forward_kernel");
    });
  });
}

void attention_backward(const StridedView& q, const StridedView& k, const StridedView& v,
                        const StridedView& out, const StridedView& dout, const StridedView& lse,
                        const StridedView& delta, const StridedView& dq, const StridedView& dk,
                        const StridedView& dv, AttentionArgs args) {
  constexpr const char* op = "attention_backward";
  const std::int64_t heads = check_operands(op, q, k, v);
  const int n = q.ndim;
  const std::int64_t t = q.shape[n - 2];
  check_rows(op, out, q, q.dtype, "out");
  check_rows(op, dq, q, q.dtype, "dq");
  check_rows(op, dk, k, q.dtype, "dk");
  check_rows(op, dv, v, q.dtype, "dv");
  check_rows(op, dout, q, q.dtype, "dout");
  for (const StridedView* x : {&lse, &delta}) {
    MB_ASSERT(x->is_contiguous() && x->numel() == heads * t && x->dtype == DType::f32,
              "[{}] lse and delta must be contiguous f32 with {} elements", op, heads * t);
  }
  dispatch_attention(q.dtype, op, [&]<class T>() {
    const AttentionOperands<T> p = operands<T>(q, k, v, out, args, &dq, &dk, &dv);
    const HeadStrides dos = head_strides(dout);
    const std::int64_t rows = heads * p.t;
    attention_delta_kernel<T><<<grid_for(rows * 32, kThreads), kThreads, 0, current_stream()>>>(
        out.ptr<T>(), p.os, dout.ptr<T>(), dos, delta.ptr<float>(), rows, p.t, p.d);
    MB_CUDA_CHECK_LAUNCH("attention_delta_kernel");
    with_head_dim(p.d, [&]<int kMaxD>() {
      if constexpr (!std::is_same_v<T, float>) {
        if (use_tensor_cores()) {
          constexpr int kBackwardRows = tc::TcGeometry<kMaxD, tc::kBackwardTiles>::kBlockRows;
          const tc::TcOperands<T> kp =
              tc_operands<T>(p, q, k, v, &dout, kMaxD, p.s, kBackwardRows);
          tc_dkdv_kernel<T, kMaxD>
              <<<tile_blocks(op, heads, kp.tiles), tc::kTcThreads, 0, current_stream()>>>(
                  kp, lse.ptr<float>(), delta.ptr<float>(), dk.ptr<T>(), dv.ptr<T>());
          MB_CUDA_CHECK_LAUNCH("tc_dkdv_kernel");
          const tc::TcOperands<T> qp =
              tc_operands<T>(p, q, k, v, &dout, kMaxD, p.t, kBackwardRows);
          tc_dq_kernel<T, kMaxD>
              <<<tile_blocks(op, heads, qp.tiles), tc::kTcThreads, 0, current_stream()>>>(
                  qp, lse.ptr<float>(), delta.ptr<float>(), dq.ptr<T>());
          MB_CUDA_CHECK_LAUNCH("tc_dq_kernel");
          return;
        }
      }
      const std::int64_t k_tiles = ceil_div(p.s, Geometry<kMaxD>::kRows);
      attention_dkdv_kernel<T, kMaxD>
          <<<tile_blocks(op, heads, k_tiles), kBlockThreads, 0, current_stream()>>>(
              p, dout.ptr<T>(), dos, lse.ptr<float>(), delta.ptr<float>(), dk.ptr<T>(), dv.ptr<T>(),
              k_tiles);
      MB_CUDA_CHECK_LAUNCH("attention_dkdv_kernel");
      const std::int64_t q_tiles = ceil_div(p.t, Geometry<kMaxD>::kRows);
      attention_dq_kernel<T, kMaxD>
          <<<tile_blocks(op, heads, q_tiles), kBlockThreads, 0, current_stream()>>>(
              p, dout.ptr<T>(), dos, lse.ptr<float>(), delta.ptr<float>(), dq.ptr<T>(), q_tiles);
      MB_CUDA_CHECK_LAUNCH("attention_dq_kernel");
    });
  });
}

}  // namespace microbatch::kernels::cuda
