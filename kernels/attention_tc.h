// The tensor-core attention kernels for f16 and bf16 (kernels/cuda/attention.cu launches them):
// the bodies of one thread block, written once against a small execution context so that the CUDA
// kernels and a CPU emulation of the warp (tests/core/test_attention_tc.cpp) run the same code.
//
// A context `Ctx` gives:
//   int thread()                      this thread's index in the block, 0..kTcThreads - 1
//   void sync()                       __syncthreads()
//   float shfl_xor(float v, int m)    __shfl_xor_sync over the full warp
//   void mma<T>(TcAcc&, TcA&, TcB&)   c += a * b, one warp-wide mma.sync.m16n8k16 (T = f16 or bf16,
//                                     f32 accumulation)
//   void ldmatrix<trans>(r[4], row)   one warp-wide ldmatrix.m8n8.x4 (.trans) from shared memory
//                                     (Note [MMA fragments])
//   void load16(w[4], p)              one 16-byte load from global memory (p 16-byte aligned)
//   void store_shared16(p, w[4])      one 16-byte store to shared memory (p 16-byte aligned)
//   void store_shared(float* p, v)    one f32 store to shared memory, and
//   float load_shared(const float* p) one f32 load from it
// Every access to shared memory goes through the context, so that the CPU emulation can check
// that the barriers order them (no thread reads or writes what another wrote, or writes what
// another read, between the same two barriers).
// Every call is made by all threads of the block (or all lanes of the warp) together.
//
// Note [Tensor-core attention]: a block of 4 warps owns kBlockRows rows (queries in the forward
// and dq kernels, keys in the dk/dv kernel), each warp kM tiles of 16 (kForwardTiles,
// kBackwardTiles), and walks the other side in tiles of kCols rows; every B fragment a warp loads
// from shared memory feeds its kM MMAs. The next walked tile is fetched into registers while the
// current one is computed (TileRegs) and stored to shared memory after it. Tiles sit in shared
// memory as 16-bit rows of kD (32, 64 or 128; zero padded past D) plus 8 halves of skew, so that
// the fragment loads of the 32 lanes hit 32 banks. Products are m16n8k16 MMAs with f32
// accumulators. A score tile S (16 x kCols per row tile) lives in registers in the accumulator
// layout; the lane holding S[r][c] also holds, after rounding to 16 bits, P[r][c] in the A-operand
// layout of the next MMA (the two layouts coincide, Note [MMA fragments]), so P and dS never go
// through shared memory. Per row the forward keeps a running max and sum (online softmax, base-2
// exponentials with log2(e) folded into the scale) and stores out and the natural-log lse; the
// backward recomputes P = exp(S - lse) per tile. The dk/dv kernel owns keys and the dq kernel owns
// queries, so every output element is written once, by one lane, after sums in a fixed order: no
// atomics, the same bits on every run.
//
// Note [MMA fragments] (PTX ISA, mma.m16n8k16 with .f16/.bf16): with g = lane / 4, t = lane % 4,
//   A (16 x 16, row-major): reg 0 = A[g][2t, 2t+1], reg 1 = A[g+8][2t, 2t+1],
//                            reg 2 = A[g][2t+8, 2t+9], reg 3 = A[g+8][2t+8, 2t+9]
//   B (16 x 8):              reg 0 = B[2t, 2t+1][g], reg 1 = B[2t+8, 2t+9][g]
//   C (16 x 8, f32):         x0, x1 = C[g][2t, 2t+1], x2, x3 = C[g+8][2t, 2t+1]
// (lower element in the low 16 bits of a register). The fragments are read from shared memory with
// ldmatrix.x4 (PTX ISA): lane l gives the address of row l % 8 of 8 x 8 matrix l / 8 (8 contiguous
// elements, 16-byte aligned), and receives in register i the elements (l / 4, 2 (l % 4) + {0, 1})
// of matrix i, or with .trans the elements (2 (l % 4) + {0, 1}, l / 4). Four matrices make one A
// fragment, or the B fragments of two adjacent n-tiles.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/half.h"
#include "kernels/attention.h"

// Device functions under nvcc (the kernels in kernels/cuda/attention.cu), host functions for the
// CPU emulation. Loops over fragments must unroll: registers cannot be indexed at run time.
#if defined(__CUDACC__)
#define MB_TC_FN __device__
#define MB_TC_UNROLL _Pragma("unroll")
#else
#define MB_TC_FN
#define MB_TC_UNROLL
#endif

namespace microbatch::kernels {

/// What every attention kernel reads of q, k and v, the f32-math ones in kernels/cuda/attention.cu
/// too: head bh of q starts at q + head_offset(qs, bh), and so on.
template <class T>
struct AttentionOperands {
  const T* q;
  const T* k;
  const T* v;
  HeadStrides qs, ks, vs;
  /// Where out (written by the forward, read by the backward's delta) and the backward's dq, dk and
  /// dv lie, laid out like q (out, dq), k (dk) and v (dv): unit stride along D, rows `row` apart.
  HeadStrides os, dqs, dks, dvs;
  std::int64_t t;  // queries per head
  std::int64_t s;  // keys per head
  std::int64_t d;  // head dim
  float scale;
  bool causal;

  /// Whether query i sees key j (both within range, and j <= i under the causal mask).
  MB_TC_FN bool visible(std::int64_t i, std::int64_t j) const {
    return i < t && j < s && (!causal || j <= i);
  }

  /// Whether every query of [i0, i0 + rows) sees every key of [j0, j0 + cols): all within range
  /// and, under the causal mask, the last key at or before the first query. Such a tile (most of
  /// them, below the diagonal) skips the per-element visible() test.
  MB_TC_FN bool sees_all(std::int64_t i0, std::int64_t rows, std::int64_t j0,
                         std::int64_t cols) const {
    return i0 + rows <= t && j0 + cols <= s && (!causal || j0 + cols - 1 <= i0);
  }
};

}  // namespace microbatch::kernels

namespace microbatch::kernels::tc {

inline constexpr int kTcWarps = 4;
inline constexpr int kTcThreads = kTcWarps * 32;
inline constexpr int kSkew = 8;  // halves of padding per shared row

template <int kD, int kM>
struct TcGeometry {
  static_assert(kD == 32 || kD == 64 || kD == 128);
  static_assert(kM == 1 || (kM == 2 && kD <= 64), "128-wide heads fit one row tile per warp");
  // A warp owns kM 16-row MMA tiles, so that each B fragment it loads feeds kM MMAs.
  static constexpr int kWarpRows = 16 * kM;
  static constexpr int kBlockRows = kTcWarps * kWarpRows;  // rows a block owns
  static constexpr int kCols = kD == 128 ? 16 : 64 / kM;   // rows of the walked side per tile
  static constexpr int kStride = kD + kSkew;               // shared row stride, in halves
  static constexpr int kDChunks = kD / 16;                 // MMA k-steps along D
  static constexpr int kDTiles = kD / 8;                   // MMA n-tiles along D
  static constexpr int kColTiles = kCols / 8;              // n-tiles along a walked tile
  static constexpr int kColChunks = kCols / 16;            // k-steps along a walked tile
  /// Shared memory of every kernel: two kBlockRows-row tiles and two kCols-row tiles, plus two
  /// floats per walked row (the dk/dv kernel's lse and delta).
  static constexpr int kSharedHalves = 2 * (kBlockRows + kCols) * kStride + 4 * kCols;
  static_assert(kSharedHalves * 2 <= 48 * 1024, "static shared memory is limited to 48 KiB");
};

/// Row tiles per warp of each kernel. Two halve the forward's shared-memory reads per MMA; the
/// backward kernels keep one, as with one they already take 200-255 registers at D = 64 and 128
/// (ptxas for sm_90, CUDA 13: dk/dv f16 D = 64 sits at the 255 cap, without spills; check with
/// -Xptxas -v after changing them). Not yet tuned on a GPU.
template <int kD>
inline constexpr int kForwardTiles = kD == 128 ? 1 : 2;
inline constexpr int kBackwardTiles = 1;

struct TcA {
  std::uint32_t r[4];
};
struct TcB {
  std::uint32_t r[2];
};
struct TcAcc {
  float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
};

/// The tensor-core kernels' operands: dout for the backward, whether each of q, k, v and dout can
/// be copied to shared memory 16 bytes at a time (D == kD, rows and base 16-byte aligned), and the
/// block tiles per head.
template <class T>
struct TcOperands : kernels::AttentionOperands<T> {
  const T* dout = nullptr;  // backward only
  HeadStrides dos;
  bool vec_q = false, vec_k = false, vec_v = false, vec_dout = false;
  std::int64_t tiles = 0;  // ceil(t / kBlockRows), or ceil(s / kBlockRows) for dk/dv
};

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kTcNegInf = -std::numeric_limits<float>::infinity();

// ---- fragments ---------------------------------------------------------------------------------

MB_TC_FN inline std::uint32_t pack_pair(std::uint16_t lo, std::uint16_t hi) {
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}

template <class T>
MB_TC_FN inline std::uint32_t pack_floats(float lo, float hi) {
  return pack_pair(T(lo).bits, T(hi).bits);
}

/// A = M[r0 .. r0+15][k0 .. k0+15] of a row-major shared tile (row stride `stride` halves).
template <class Ctx>
MB_TC_FN TcA load_a(Ctx& ctx, const std::uint16_t* m, int stride, int r0, int k0) {
  const int lane = ctx.thread() & 31, mat = lane >> 3;
  TcA a;
  const int row = r0 + (mat & 1) * 8 + (lane & 7), col = k0 + (mat >> 1) * 8;
  ctx.template ldmatrix<false>(a.r, m + row * stride + col);
  return a;
}

/// The B fragments of n-tiles n0 and n0 + 8, k-step k0.
struct TcB2 {
  TcB b[2];
};

/// B[k][n] = M[n0 + n][k0 + k]: the tile's rows are B's columns (k^T in q k^T).
template <class Ctx>
MB_TC_FN TcB2 load_b_rows(Ctx& ctx, const std::uint16_t* m, int stride, int n0, int k0) {
  const int lane = ctx.thread() & 31, mat = lane >> 3;
  std::uint32_t r[4];
  const int row = n0 + (mat >> 1) * 8 + (lane & 7), col = k0 + (mat & 1) * 8;
  ctx.template ldmatrix<false>(r, m + row * stride + col);
  return {{{{r[0], r[1]}}, {{r[2], r[3]}}}};
}

/// B[k][n] = M[k0 + k][n0 + n]: the tile as it is (v in p v), read transposed.
template <class Ctx>
MB_TC_FN TcB2 load_b_cols(Ctx& ctx, const std::uint16_t* m, int stride, int k0, int n0) {
  const int lane = ctx.thread() & 31, mat = lane >> 3;
  std::uint32_t r[4];
  const int row = k0 + (mat & 1) * 8 + (lane & 7), col = n0 + (mat >> 1) * 8;
  ctx.template ldmatrix<true>(r, m + row * stride + col);
  return {{{{r[0], r[1]}}, {{r[2], r[3]}}}};
}

/// The A operand holding, rounded to T, the 16 x 16 accumulator block whose columns 0-7 are `lo`
/// and 8-15 are `hi` (Note [MMA fragments]).
template <class T>
MB_TC_FN inline TcA to_a(const TcAcc& lo, const TcAcc& hi) {
  return {{pack_floats<T>(lo.x[0], lo.x[1]), pack_floats<T>(lo.x[2], lo.x[3]),
           pack_floats<T>(hi.x[0], hi.x[1]), pack_floats<T>(hi.x[2], hi.x[3])}};
}

// ---- tiles -------------------------------------------------------------------------------------

/// Eight consecutive 16-bit elements of a row, as four words (element 2i in the low half of w[i]).
struct TcPiece {
  std::uint32_t w[4];
};

/// One thread's share of a (kRows, kD) tile in registers: piece k covers row idx / (kD / 8),
/// columns 8 * (idx % (kD / 8)) + 0..7, with idx = thread + k * kTcThreads. Tiles are fetched from
/// global memory into these registers a tile ahead (fetch_tile), so that the loads are in flight
/// while the current tile is computed, and stored to shared memory when it is done (store_tile).
template <int kD, int kRows>
struct TileRegs {
  static constexpr int kPieces = kRows * (kD / 8) / kTcThreads;
  static_assert(kPieces * kTcThreads == kRows * (kD / 8), "a tile splits evenly over the threads");
  TcPiece piece[kPieces];
};

/// Whether fetch_tile may read a head layout's rows 16 bytes at a time (its `vec`): rows of
/// exactly kd 16-bit elements (kd a multiple of 8), every one starting on a 16-byte boundary, as
/// the data's address and every row, head and batch stride in elements being a multiple of 8 make
/// them. GPT's q, k and v, views of one (B, T, 3C) buffer at offsets 0, C and 2C, qualify.
inline bool vector_rows(const void* data, const HeadStrides& hs, std::int64_t d, int kd) {
  return d == kd && kd % 8 == 0 && reinterpret_cast<std::uintptr_t>(data) % 16 == 0 &&
         hs.row % 8 == 0 && hs.batch % 8 == 0 && hs.head % 8 == 0;
}

/// regs = rows first .. first + kRows - 1 of src, columns 0 .. kD - 1; zero past `rows` or `d`.
/// `vec`: the rows are exactly kD long and 16-byte aligned, so a piece is one 16-byte load.
template <int kD, int kRows, class T, class Ctx>
MB_TC_FN void fetch_tile(Ctx& ctx, TileRegs<kD, kRows>& regs, const T* src,
                         std::int64_t row_stride, std::int64_t first, std::int64_t rows,
                         std::int64_t d, bool vec) {
  constexpr int kPerRow = kD / 8;
  MB_TC_UNROLL
  for (int k = 0; k < TileRegs<kD, kRows>::kPieces; ++k) {
    const int idx = ctx.thread() + k * kTcThreads;
    const int c = (idx % kPerRow) * 8;
    const std::int64_t row = first + idx / kPerRow;
    TcPiece& out = regs.piece[k];
    const T* in = src + row * row_stride + c;
    if (vec && row < rows) {
      ctx.load16(out.w, in);
    } else {
      MB_TC_UNROLL
      for (int e = 0; e < 4; ++e) {
        const std::uint16_t lo = row < rows && c + 2 * e < d ? in[2 * e].bits : 0;
        const std::uint16_t hi = row < rows && c + 2 * e + 1 < d ? in[2 * e + 1].bits : 0;
        out.w[e] = pack_pair(lo, hi);
      }
    }
  }
}

/// tile[r][c] (row stride kD + kSkew) = the fetched (kRows, kD) tile.
template <int kD, int kRows, class Ctx>
MB_TC_FN void store_tile(Ctx& ctx, std::uint16_t* tile, const TileRegs<kD, kRows>& regs) {
  constexpr int kPerRow = kD / 8;
  MB_TC_UNROLL
  for (int k = 0; k < TileRegs<kD, kRows>::kPieces; ++k) {
    const int idx = ctx.thread() + k * kTcThreads;
    std::uint16_t* out = tile + (idx / kPerRow) * (kD + kSkew) + (idx % kPerRow) * 8;
    ctx.store_shared16(out, regs.piece[k].w);
  }
}

/// fetch_tile then store_tile: the block's own tiles, loaded once.
template <int kD, int kRows, class T, class Ctx>
MB_TC_FN void load_tile(Ctx& ctx, std::uint16_t* tile, const T* src, std::int64_t row_stride,
                        std::int64_t first, std::int64_t rows, std::int64_t d, bool vec) {
  TileRegs<kD, kRows> regs;
  fetch_tile(ctx, regs, src, row_stride, first, rows, d, vec);
  store_tile(ctx, tile, regs);
}

/// max with NaN winning, as ops::Maximum.
MB_TC_FN inline float tc_max(float a, float b) { return (a != a || a > b) ? a : b; }

/// The sum over the 4 lanes of a quad (the lanes holding one accumulator row).
template <class Ctx>
MB_TC_FN inline float quad_sum(Ctx& ctx, float v) {
  v += ctx.shfl_xor(v, 1);
  return v + ctx.shfl_xor(v, 2);
}

template <class Ctx>
MB_TC_FN inline float quad_max(Ctx& ctx, float v) {
  v = tc_max(v, ctx.shfl_xor(v, 1));
  return tc_max(v, ctx.shfl_xor(v, 2));
}

/// Which tile a block's rows are. Under a causal mask the last query tile walks the most keys
/// (forward, dq) and the first key tile the most queries (dk, dv); the lowest block numbers take
/// the longest walks, so that they start earliest and the grid does not end on them.
enum class TileOrder { LastFirst, FirstFirst };
MB_TC_FN inline std::int64_t tile_of(std::int64_t block, std::int64_t tiles, TileOrder order) {
  return order == TileOrder::LastFirst ? tiles - 1 - block % tiles : block % tiles;
}

/// row[col] = T(acc[nd].x[2h + e] * factor) for the columns col = nd * 8 + 2t + e this lane holds
/// in accumulator row half h (Note [MMA fragments]), those below d.
template <class T, int kTiles>
MB_TC_FN inline void store_row(T* row, const TcAcc (&acc)[kTiles], int h, int t,
                                     std::int64_t d, float factor) {
  MB_TC_UNROLL
  for (int nd = 0; nd < kTiles; ++nd) {
    MB_TC_UNROLL
    for (int e = 0; e < 2; ++e) {
      const int col = nd * 8 + 2 * t + e;
      if (col < d) row[col] = T(acc[nd].x[2 * h + e] * factor);
    }
  }
}

// ---- the two kinds of product -----------------------------------------------------------------

/// acc[mi][nt] += rows . cols^T over kD: the warp's kM 16-row tiles of `rows` (a block-owned
/// (kBlockRows, kD) shared tile, from row r0) against the kCols rows of `cols` (a walked
/// (kCols, kD) shared tile), as scores S = q k^T or dP = dout v^T (transposed in dk/dv).
template <class T, class G, int M, class Ctx>
MB_TC_FN void add_row_products(Ctx& ctx, TcAcc (&acc)[M][G::kColTiles], const std::uint16_t* rows,
                               const std::uint16_t* cols, int r0) {
  MB_TC_UNROLL
  for (int kc = 0; kc < G::kDChunks; ++kc) {
    TcA a[M];
    MB_TC_UNROLL
    for (int mi = 0; mi < M; ++mi) a[mi] = load_a(ctx, rows, G::kStride, r0 + 16 * mi, kc * 16);
    MB_TC_UNROLL
    for (int nt = 0; nt < G::kColTiles; nt += 2) {
      const TcB2 b = load_b_rows(ctx, cols, G::kStride, nt * 8, kc * 16);
      MB_TC_UNROLL
      for (int mi = 0; mi < M; ++mi) {
        MB_TC_UNROLL
        for (int u = 0; u < 2; ++u) ctx.template mma<T>(acc[mi][nt + u], a[mi], b.b[u]);
      }
    }
  }
}

/// acc[mi][nd] += x[mi] . tile: score-shaped accumulators x (the warp's kM 16 x kCols tiles of P or
/// dS), rounded to T as A operands, times a walked (kCols, kD) shared tile read as it is, as
/// out += P v, dq += dS k, dv += P^T dout, dk += dS^T q.
template <class T, class G, int M, class Ctx>
MB_TC_FN void add_tile_products(Ctx& ctx, TcAcc (&acc)[M][G::kDTiles],
                                const TcAcc (&x)[M][G::kColTiles], const std::uint16_t* tile) {
  MB_TC_UNROLL
  for (int kc = 0; kc < G::kColChunks; ++kc) {
    TcA a[M];
    MB_TC_UNROLL
    for (int mi = 0; mi < M; ++mi) a[mi] = to_a<T>(x[mi][2 * kc], x[mi][2 * kc + 1]);
    MB_TC_UNROLL
    for (int nd = 0; nd < G::kDTiles; nd += 2) {
      const TcB2 b = load_b_cols(ctx, tile, G::kStride, kc * 16, nd * 8);
      MB_TC_UNROLL
      for (int mi = 0; mi < M; ++mi) {
        MB_TC_UNROLL
        for (int u = 0; u < 2; ++u) ctx.template mma<T>(acc[mi][nd + u], a[mi], b.b[u]);
      }
    }
  }
}

// ---- forward -----------------------------------------------------------------------------------

/// out and lse (kernels/attention.h) for the kBlockRows queries of block `block` (Note
/// [Tensor-core attention]). `smem` holds TcGeometry<kD, kM>::kSharedHalves halves, 16-byte
/// aligned (the same in the other two kernels).
template <class T, int kD, int kM, class Ctx>
MB_TC_FN void tc_forward_block(Ctx& ctx, const TcOperands<T>& p, T* out, float* lse,
                               std::int64_t block, std::uint16_t* smem) {
  using G = TcGeometry<kD, kM>;
  constexpr int P = G::kStride, M = kM;
  std::uint16_t* q_s = smem;                      // (kBlockRows, kD) queries
  std::uint16_t* k_s = q_s + G::kBlockRows * P;   // (kCols, kD) keys
  std::uint16_t* v_s = k_s + G::kCols * P;        // (kCols, kD) values
  const std::int64_t bh = block / p.tiles;
  const std::int64_t i0 = tile_of(block, p.tiles, TileOrder::LastFirst) * G::kBlockRows;
  const int lane = ctx.thread() & 31, r0 = (ctx.thread() >> 5) * G::kWarpRows;
  const int g = lane >> 2, t = lane & 3;
  const T* k = p.k + head_offset(p.ks, bh);
  const T* v = p.v + head_offset(p.vs, bh);
  load_tile<kD, G::kBlockRows>(ctx, q_s, p.q + head_offset(p.qs, bh), p.qs.row, i0, p.t, p.d,
                               p.vec_q);
  ctx.sync();
  TcA qf[M][G::kDChunks];
  MB_TC_UNROLL
  for (int mi = 0; mi < M; ++mi) {
    MB_TC_UNROLL
    for (int kc = 0; kc < G::kDChunks; ++kc)
      qf[mi][kc] = load_a(ctx, q_s, P, r0 + 16 * mi, kc * 16);
  }

  const float scale2 = p.scale * kLog2e;
  float m[M][2], l[M][2];  // rows g and g + 8 of each row tile, base 2
  MB_TC_UNROLL
  for (int mi = 0; mi < M; ++mi) {
    m[mi][0] = m[mi][1] = kTcNegInf;
    l[mi][0] = l[mi][1] = 0.0f;
  }
  TcAcc o[M][G::kDTiles];
  // Causal: no query of this block sees a key past its last query.
  const std::int64_t key_end = p.causal ? std::min(p.s, i0 + G::kBlockRows) : p.s;
  TileRegs<kD, G::kCols> k_next, v_next;
  fetch_tile(ctx, k_next, k, p.ks.row, 0, p.s, p.d, p.vec_k);
  fetch_tile(ctx, v_next, v, p.vs.row, 0, p.s, p.d, p.vec_v);
  for (std::int64_t j0 = 0; j0 < key_end; j0 += G::kCols) {
    ctx.sync();  // every warp is done with the previous tile
    store_tile(ctx, k_s, k_next);
    store_tile(ctx, v_s, v_next);
    ctx.sync();
    if (j0 + G::kCols < key_end) {  // the next tile's loads fly while this one is computed
      fetch_tile(ctx, k_next, k, p.ks.row, j0 + G::kCols, p.s, p.d, p.vec_k);
      fetch_tile(ctx, v_next, v, p.vs.row, j0 + G::kCols, p.s, p.d, p.vec_v);
    }

    const bool full = p.sees_all(i0, G::kBlockRows, j0, G::kCols);  // the same for the block
    TcAcc sc[M][G::kColTiles];
    MB_TC_UNROLL
    for (int nt = 0; nt < G::kColTiles; nt += 2) {
      MB_TC_UNROLL
      for (int kc = 0; kc < G::kDChunks; ++kc) {
        const TcB2 b = load_b_rows(ctx, k_s, P, nt * 8, kc * 16);
        MB_TC_UNROLL
        for (int mi = 0; mi < M; ++mi) {
          ctx.template mma<T>(sc[mi][nt], qf[mi][kc], b.b[0]);
          ctx.template mma<T>(sc[mi][nt + 1], qf[mi][kc], b.b[1]);
        }
      }
    }
    MB_TC_UNROLL
    for (int mi = 0; mi < M; ++mi) {
      MB_TC_UNROLL
      for (int h = 0; h < 2; ++h) {
        const std::int64_t i = i0 + r0 + 16 * mi + g + 8 * h;
        float mx = kTcNegInf;
        MB_TC_UNROLL
        for (int nt = 0; nt < G::kColTiles; ++nt) {
          MB_TC_UNROLL
          for (int e = 0; e < 2; ++e) {
            float& x = sc[mi][nt].x[2 * h + e];
            x = full || p.visible(i, j0 + nt * 8 + 2 * t + e) ? x * scale2 : kTcNegInf;
            mx = tc_max(mx, x);
          }
        }
        const float m_new = tc_max(m[mi][h], quad_max(ctx, mx));
        // m_new stays -inf while every key so far is masked: nothing to add, nothing to rescale.
        const bool none = m_new == kTcNegInf;
        const float correction = none ? 1.0f : exp2f(m[mi][h] - m_new);  // 0 on the first key
        float sum = 0.0f;
        MB_TC_UNROLL
        for (int nt = 0; nt < G::kColTiles; ++nt) {
          MB_TC_UNROLL
          for (int e = 0; e < 2; ++e) {
            float& x = sc[mi][nt].x[2 * h + e];
            x = none ? 0.0f : exp2f(x - m_new);
            sum += x;
          }
        }
        l[mi][h] = l[mi][h] * correction + sum;  // this lane's columns; the quad's summed later
        m[mi][h] = m_new;
        MB_TC_UNROLL
        for (int nd = 0; nd < G::kDTiles; ++nd) {
          o[mi][nd].x[2 * h] *= correction;
          o[mi][nd].x[2 * h + 1] *= correction;
        }
      }
    }
    add_tile_products<T, G>(ctx, o, sc, v_s);
  }

  MB_TC_UNROLL
  for (int mi = 0; mi < M; ++mi) {
    MB_TC_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float total = quad_sum(ctx, l[mi][h]);
      const std::int64_t i = i0 + r0 + 16 * mi + g + 8 * h;
      if (i >= p.t) continue;
      // total > 0 whenever the query sees a key, which key 0 always is; guard all the same.
      store_row(out + head_offset(p.os, bh) + i * p.os.row, o[mi], h, t, p.d, total > 0.0f ? 1.0f / total : 0.0f);
      if (t == 0) lse[bh * p.t + i] = total > 0.0f ? (m[mi][h] + log2f(total)) * kLn2 : kTcNegInf;
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------

/// dk and dv for the kBlockRows keys of block `block`: walks the query tiles that see them,
/// recomputing S^T = k q^T and dP^T = v dout^T, then P^T = exp(S^T - lse),
/// dS^T = P^T * (dP^T - delta), dv += P^T dout, dk += dS^T q; dk is scaled once at the end.
/// Overwrites dk and dv.
template <class T, int kD, int kM, class Ctx>
MB_TC_FN void tc_dkdv_block(Ctx& ctx, const TcOperands<T>& p, const float* lse,
                            const float* delta, T* dk, T* dv, std::int64_t block,
                            std::uint16_t* smem) {
  using G = TcGeometry<kD, kM>;
  constexpr int P = G::kStride, M = kM;
  std::uint16_t* k_s = smem;                      // (kBlockRows, kD) keys
  std::uint16_t* v_s = k_s + G::kBlockRows * P;   // (kBlockRows, kD) values
  std::uint16_t* q_s = v_s + G::kBlockRows * P;   // (kCols, kD) queries
  std::uint16_t* do_s = q_s + G::kCols * P;       // (kCols, kD) output gradients
  float* lse_s = reinterpret_cast<float*>(do_s + G::kCols * P);  // (kCols) lse * log2(e)
  float* delta_s = lse_s + G::kCols;                              // (kCols)
  const std::int64_t bh = block / p.tiles;
  const std::int64_t j0 = tile_of(block, p.tiles, TileOrder::FirstFirst) * G::kBlockRows;
  const int lane = ctx.thread() & 31, r0 = (ctx.thread() >> 5) * G::kWarpRows;
  const int g = lane >> 2, t = lane & 3;
  const T* q = p.q + head_offset(p.qs, bh);
  const T* dout = p.dout + head_offset(p.dos, bh);
  load_tile<kD, G::kBlockRows>(ctx, k_s, p.k + head_offset(p.ks, bh), p.ks.row, j0, p.s, p.d,
                               p.vec_k);
  load_tile<kD, G::kBlockRows>(ctx, v_s, p.v + head_offset(p.vs, bh), p.vs.row, j0, p.s, p.d,
                               p.vec_v);

  const float scale2 = p.scale * kLog2e;
  TcAcc dk_acc[M][G::kDTiles], dv_acc[M][G::kDTiles];
  // Causal: queries before the block's first key see none of its keys.
  const std::int64_t first = p.causal ? (j0 / G::kCols) * G::kCols : 0;
  // The next query tile, fetched while the current one is computed; thread c < kCols also holds
  // query c's lse (base 2) and delta.
  TileRegs<kD, G::kCols> q_next, do_next;
  float lse_next = 0.0f, delta_next = 0.0f;
  auto fetch = [&](std::int64_t i0) {
    fetch_tile(ctx, q_next, q, p.qs.row, i0, p.t, p.d, p.vec_q);
    fetch_tile(ctx, do_next, dout, p.dos.row, i0, p.t, p.d, p.vec_dout);
    const std::int64_t i = i0 + ctx.thread();
    if (ctx.thread() < G::kCols && i < p.t) {
      lse_next = lse[bh * p.t + i] * kLog2e;
      delta_next = delta[bh * p.t + i];
    } else {
      lse_next = delta_next = 0.0f;
    }
  };
  if (first < p.t) fetch(first);
  for (std::int64_t i0 = first; i0 < p.t; i0 += G::kCols) {
    ctx.sync();  // every warp is done with the previous tile
    store_tile(ctx, q_s, q_next);
    store_tile(ctx, do_s, do_next);
    if (ctx.thread() < G::kCols) {
      ctx.store_shared(lse_s + ctx.thread(), lse_next);
      ctx.store_shared(delta_s + ctx.thread(), delta_next);
    }
    ctx.sync();  // the tiles (and, on the first pass, k_s and v_s) are in place
    if (i0 + G::kCols < p.t) fetch(i0 + G::kCols);

    const bool full = p.sees_all(i0, G::kCols, j0, G::kBlockRows);  // the same for the block
    TcAcc st[M][G::kColTiles], dpt[M][G::kColTiles];  // S^T and dP^T: rows keys, columns queries
    add_row_products<T, G>(ctx, st, k_s, q_s, r0);
    add_row_products<T, G>(ctx, dpt, v_s, do_s, r0);
    MB_TC_UNROLL
    for (int mi = 0; mi < M; ++mi) {
      MB_TC_UNROLL
      for (int nt = 0; nt < G::kColTiles; ++nt) {
        MB_TC_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + 2 * t + (e & 1);
          const std::int64_t j = j0 + r0 + 16 * mi + g + 8 * (e >> 1);
          const bool seen = full || p.visible(i0 + c, j);
          const float pr =
              seen ? exp2f(st[mi][nt].x[e] * scale2 - ctx.load_shared(lse_s + c)) : 0.0f;
          dpt[mi][nt].x[e] = seen ? pr * (dpt[mi][nt].x[e] - ctx.load_shared(delta_s + c)) : 0.0f;
          st[mi][nt].x[e] = pr;
        }
      }
    }
    add_tile_products<T, G>(ctx, dv_acc, st, do_s);
    add_tile_products<T, G>(ctx, dk_acc, dpt, q_s);
  }

  MB_TC_UNROLL
  for (int mi = 0; mi < M; ++mi) {
    MB_TC_UNROLL
    for (int h = 0; h < 2; ++h) {
      const std::int64_t j = j0 + r0 + 16 * mi + g + 8 * h;
      if (j >= p.s) continue;
      store_row(dk + head_offset(p.dks, bh) + j * p.dks.row, dk_acc[mi], h, t, p.d, p.scale);
      store_row(dv + head_offset(p.dvs, bh) + j * p.dvs.row, dv_acc[mi], h, t, p.d, 1.0f);
    }
  }
}

/// dq for the kBlockRows queries of block `block`: walks the key tiles they see, recomputing
/// S = q k^T and dP = dout v^T, then dS = exp(S - lse) * (dP - delta), dq += dS k, scaled once at
/// the end. Overwrites dq.
template <class T, int kD, int kM, class Ctx>
MB_TC_FN void tc_dq_block(Ctx& ctx, const TcOperands<T>& p, const float* lse, const float* delta,
                          T* dq, std::int64_t block, std::uint16_t* smem) {
  using G = TcGeometry<kD, kM>;
  constexpr int P = G::kStride, M = kM;
  std::uint16_t* q_s = smem;                      // (kBlockRows, kD) queries
  std::uint16_t* do_s = q_s + G::kBlockRows * P;  // (kBlockRows, kD) output gradients
  std::uint16_t* k_s = do_s + G::kBlockRows * P;  // (kCols, kD) keys
  std::uint16_t* v_s = k_s + G::kCols * P;        // (kCols, kD) values
  const std::int64_t bh = block / p.tiles;
  const std::int64_t i0 = tile_of(block, p.tiles, TileOrder::LastFirst) * G::kBlockRows;
  const int lane = ctx.thread() & 31, r0 = (ctx.thread() >> 5) * G::kWarpRows;
  const int g = lane >> 2, t = lane & 3;
  const T* k = p.k + head_offset(p.ks, bh);
  const T* v = p.v + head_offset(p.vs, bh);
  load_tile<kD, G::kBlockRows>(ctx, q_s, p.q + head_offset(p.qs, bh), p.qs.row, i0, p.t, p.d,
                               p.vec_q);
  load_tile<kD, G::kBlockRows>(ctx, do_s, p.dout + head_offset(p.dos, bh), p.dos.row, i0, p.t,
                               p.d, p.vec_dout);
  float lse2[M][2], delta_r[M][2];  // rows g and g + 8 of each row tile
  MB_TC_UNROLL
  for (int mi = 0; mi < M; ++mi) {
    MB_TC_UNROLL
    for (int h = 0; h < 2; ++h) {
      const std::int64_t i = i0 + r0 + 16 * mi + g + 8 * h;
      lse2[mi][h] = i < p.t ? lse[bh * p.t + i] * kLog2e : 0.0f;
      delta_r[mi][h] = i < p.t ? delta[bh * p.t + i] : 0.0f;
    }
  }

  const float scale2 = p.scale * kLog2e;
  TcAcc dq_acc[M][G::kDTiles];
  const std::int64_t key_end = p.causal ? std::min(p.s, i0 + G::kBlockRows) : p.s;
  TileRegs<kD, G::kCols> k_next, v_next;
  fetch_tile(ctx, k_next, k, p.ks.row, 0, p.s, p.d, p.vec_k);
  fetch_tile(ctx, v_next, v, p.vs.row, 0, p.s, p.d, p.vec_v);
  for (std::int64_t j0 = 0; j0 < key_end; j0 += G::kCols) {
    ctx.sync();  // every warp is done with the previous tile
    store_tile(ctx, k_s, k_next);
    store_tile(ctx, v_s, v_next);
    ctx.sync();  // the tiles (and, on the first pass, q_s and do_s) are in place
    if (j0 + G::kCols < key_end) {  // the next tile's loads fly while this one is computed
      fetch_tile(ctx, k_next, k, p.ks.row, j0 + G::kCols, p.s, p.d, p.vec_k);
      fetch_tile(ctx, v_next, v, p.vs.row, j0 + G::kCols, p.s, p.d, p.vec_v);
    }

    const bool full = p.sees_all(i0, G::kBlockRows, j0, G::kCols);  // the same for the block
    TcAcc sc[M][G::kColTiles], dp[M][G::kColTiles];
    add_row_products<T, G>(ctx, sc, q_s, k_s, r0);
    add_row_products<T, G>(ctx, dp, do_s, v_s, r0);
    MB_TC_UNROLL
    for (int mi = 0; mi < M; ++mi) {
      MB_TC_UNROLL
      for (int nt = 0; nt < G::kColTiles; ++nt) {
        MB_TC_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          const std::int64_t i = i0 + r0 + 16 * mi + g + 8 * h;
          const bool seen = full || p.visible(i, j0 + nt * 8 + 2 * t + (e & 1));
          sc[mi][nt].x[e] = seen ? exp2f(sc[mi][nt].x[e] * scale2 - lse2[mi][h]) *
                                       (dp[mi][nt].x[e] - delta_r[mi][h])
                                 : 0.0f;
        }
      }
    }
    add_tile_products<T, G>(ctx, dq_acc, sc, k_s);
  }

  MB_TC_UNROLL
  for (int mi = 0; mi < M; ++mi) {
    MB_TC_UNROLL
    for (int h = 0; h < 2; ++h) {
      const std::int64_t i = i0 + r0 + 16 * mi + g + 8 * h;
      if (i >= p.t) continue;
      store_row(dq + head_offset(p.dqs, bh) + i * p.dqs.row, dq_acc[mi], h, t, p.d, p.scale);
    }
  }
}

}  // namespace microbatch::kernels::tc
