// cuda::gemm: C = alpha * A @ B + beta * C through cublasGemmStridedBatchedEx. Overwrites C
// (beta = 0) or accumulates into it (beta = 1: the weight-gradient GEMM adds w * dy^T x straight
// into the gradient arena, Note [Weight-gradient GEMM] in core/ops/linalg.cpp).
//
// Note [Row-major GEMM on cuBLAS]: cuBLAS is column-major, and a row-major (R, C) matrix with row
// stride ld reads, column-major, as its transpose (C, R) with leading dimension ld. So C = A B is
// computed as C^T = B^T A^T: cuBLAS's first operand is B, its second A, and its (N, M) output is C
// as stored. An operand stored row-major (column stride 1) is thus already the transpose cuBLAS
// wants (CUBLAS_OP_N, ld = row stride); one stored column-major (row stride 1: a transposed view)
// is passed with CUBLAS_OP_T and ld = column stride. blas_matrix (kernels/gemm.h) decides which.
//
// Note [Bias in the GEMM's epilogue]: linear's forward adds its bias in cuBLASLt's epilogue
// (CUBLASLT_EPILOGUE_BIAS, as torch's addmm does): the bias joins the f32 accumulator and the sum is
// rounded once, without first writing the bias into every output row and reading the rows back
// (at GPT-2 small's micro-batch 8 those two passes move about 2.7 GB per step). The algorithm the
// Lt heuristic picks is kept per shape, layout and pointer alignments. Where Lt has none (f64,
// f32 output from 16-bit inputs, a batch, a strided bias) or MB_CUBLASLT_EPILOGUE=0, the rows are
// written first and cublasGemmStridedBatchedEx adds the product onto them (beta = 1): the same sum,
// possibly added in another order. So does a bias that is not 16-byte aligned (Lt has no alignment
// preference for it), and a shape whose Lt call is refused.
//
// Precision: f32 runs with CUBLAS_COMPUTE_32F, never TF32 (f32 means f32); f16 and bf16 inputs
// accumulate in f32 (CUBLAS_COMPUTE_32F, tensor cores) and round once into a 16-bit or f32 C; f64
// runs in f64. alpha and beta are passed in the compute type (float, or double for f64).
#include <atomic>
#include <climits>
#include <compare>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"

namespace microbatch::kernels::cuda {

namespace {

// c = beta * c where the product is empty (k = 0); beta = 0 writes zeros without reading c, as
// the CPU kernel does. Overwrites c.
template <class T>
__global__ void scale_kernel(StridedView c, compute_t<T> beta, std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const std::int64_t off = strided_offset(c, i);
    const compute_t<T> v = beta == compute_t<T>(0) ? compute_t<T>(0) : beta * load<T>(c.data, off);
    store<T>(c.data, off, v);
  }
}

// "(2, 3, 4) strides (12, 4, 1) bf16", for error messages.
std::string describe(const StridedView& v) {
  std::ostringstream os;
  os << '(';
  for (int d = 0; d < v.ndim; ++d) os << (d ? ", " : "") << v.shape[d];
  os << ") strides (";
  for (int d = 0; d < v.ndim; ++d) os << (d ? ", " : "") << v.strides[d];
  os << ") " << dtype_name(v.dtype);
  return os.str();
}

cudaDataType_t blas_type(DType dt) {
  switch (dt) {
    case DType::f32: return CUDA_R_32F;
    case DType::f64: return CUDA_R_64F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: break;
  }
  MB_ASSERT(false, "[gemm] no cuBLAS type for {}", dtype_name(dt));
  return CUDA_R_32F;
}

// One operand as cuBLAS takes it: the op applied to its stored matrix, ld, and batch stride.
struct Operand {
  cublasOperation_t op = CUBLAS_OP_N;
  std::int64_t ld = 1;
  long long batch_stride = 0;
};

Operand operand(const char* name, const StridedView& v, std::int64_t batch, const StridedView& a,
                const StridedView& b, const StridedView& c) {
  const BlasMatrix m = blas_matrix(v.shape[1], v.shape[2], v.strides[1], v.strides[2]);
  MB_CHECK(m.ok,
           "[gemm] operand {} has no unit stride with a valid leading dimension (make it contiguous): "
           "a {}, b {}, c {}", name, describe(a), describe(b), describe(c));
  MB_CHECK(v.shape[0] == batch || v.shape[0] == 1,
           "[gemm] operand {} has batch {} but c has {}: a {}, b {}, c {}", name, v.shape[0], batch,
           describe(a), describe(b), describe(c));
  Operand o;
  o.op = m.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  o.ld = m.ld;
  o.batch_stride = v.shape[0] == 1 ? 0 : v.strides[0];
  return o;
}

// c's rows = bias, the fallback's first step: the GEMM then adds onto them (beta = 1).
template <class T>
__global__ void bias_rows_kernel(T* c, std::int64_t row_stride, std::int64_t col_stride,
                                 const T* bias, std::int64_t bias_stride, std::int64_t rows,
                                 std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const std::int64_t row = i / cols, col = i % cols;
    c[row * row_stride + col * col_stride] = bias[col * bias_stride];
  }
}

// The largest power of two up to 256 that divides the address: the alignment cuBLASLt is told.
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// What the algorithm cuBLASLt picks depends on: the device, the type, the transposes, the sizes,
// the leading dimensions and the alignments of the four pointers.
struct LtKey {
  int device;
  DType dtype;
  int epilogue;
  int op_b, op_a;
  std::int64_t m, n, k, ldb, lda, ldc, ld_aux;
  std::uint32_t align_b, align_a, align_c, align_bias, align_aux;
  auto operator<=>(const LtKey&) const = default;
};

// The algorithm for a key, or none (ok false): Lt offered none, or refused the call, and then
// why (describe_refusal), which every later call of that key reports.
struct LtChoice {
  bool ok = false;
  cublasLtMatmulAlgo_t algo{};
  std::string refusal;
};

// One line on a call cuBLASLt declined, for lt_last_refusal.
std::string describe_refusal(const char* why, const LtKey& k) {
  return MB_FORMAT("{}: epilogue {}, {}, D^T ({} x {}) = op{}(B) @ op{}(A) over k {}, ld b {} a {} c {} "
                   "aux {}, alignments b {} a {} c {} bias {} aux {}",
                   why, k.epilogue, dtype_name(k.dtype), k.n, k.m, k.op_b == CUBLAS_OP_N ? "N" : "T",
                   k.op_a == CUBLAS_OP_N ? "N" : "T", k.k, k.ldb, k.lda, k.ldc, k.ld_aux, k.align_b,
                   k.align_a, k.align_c, k.align_bias, k.align_aux);
}

std::mutex g_lt_mutex;
std::map<LtKey, LtChoice>& lt_algos() {
  static auto* algos = new std::map<LtKey, LtChoice>();
  return *algos;
}

// Owners of the Lt descriptors of one call.
struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtDescs() = default;
  LtDescs(const LtDescs&) = delete;
  LtDescs& operator=(const LtDescs&) = delete;
  ~LtDescs() {
    if (pref != nullptr) (void)cublasLtMatmulPreferenceDestroy(pref);
    if (c != nullptr) (void)cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) (void)cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) (void)cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) (void)cublasLtMatmulDescDestroy(op);
  }
};

template <class V>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& value) {
  MB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}
template <class V>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
              const V& value) {
  MB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)));
}

// cuBLASLt calls done, by epilogue (lt_epilogue_calls).
std::atomic<std::int64_t> g_lt_bias{0}, g_lt_gelu{0}, g_lt_dgelu{0};
// Why the last call did not run on cuBLASLt (lt_last_refusal), guarded by g_lt_mutex: a call Lt
// declined, described when it happens (once per shape, its refusal is cached), or a call not
// offered to it, kept as its facts and described only when asked (that happens on every call).
std::string g_lt_refusal;
struct NotOffered {
  bool types, layout, vectors;
  StridedView c;
};
std::optional<NotOffered> g_not_offered;
// Makes `why` (a refusal's describe_refusal) what lt_last_refusal reports; g_lt_mutex held.
void remember_refusal(const std::string& why) {
  g_not_offered.reset();
  g_lt_refusal = why;
}

// Whether the bias epilogue is wanted: on unless MB_CUBLASLT_EPILOGUE is "0" (read once).
bool& epilogue_wanted() {
  static bool wanted = [] {
    const char* env = std::getenv("MB_CUBLASLT_EPILOGUE");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return wanted;
}

}  // namespace

void gemm(const StridedView& a, const StridedView& b, const StridedView& c, double alpha,
          double beta) {
  MB_CHECK(a.ndim == 3 && b.ndim == 3 && c.ndim == 3,
           "[gemm] expected 3-d views (batch, rows, cols): a {}, b {}, c {}", describe(a), describe(b),
           describe(c));
  const std::int64_t batch = c.shape[0], m = c.shape[1], n = c.shape[2], k = a.shape[2];
  MB_CHECK(a.shape[1] == m && b.shape[1] == k && b.shape[2] == n,
           "[gemm] shapes do not chain: a {} @ b {} -> c {}", describe(a), describe(b), describe(c));
  MB_CHECK(a.dtype == b.dtype, "[gemm] a and b differ in dtype: a {}, b {}", describe(a), describe(b));
  const bool sixteen = a.dtype == DType::f16 || a.dtype == DType::bf16;
  MB_CHECK(is_floating(a.dtype) && (c.dtype == a.dtype || (sixteen && c.dtype == DType::f32)),
           "[gemm] unsupported dtypes (c must have a's dtype, or f32 for 16-bit a and b): a {}, b {}, "
           "c {}", describe(a), describe(b), describe(c));
  if (batch == 0 || m == 0 || n == 0) return;

  if (k == 0) {
    const std::int64_t total = batch * m * n;
    dispatch_float(c.dtype, "gemm", [&]<class T>() {
      scale_kernel<T><<<grid_for(total, kThreads), kThreads, 0, current_stream()>>>(
          c, static_cast<compute_t<T>>(beta), total);
      MB_CUDA_CHECK_LAUNCH("gemm scale_kernel");
    });
    return;
  }

  const Operand oa = operand("a", a, batch, a, b, c), ob = operand("b", b, batch, a, b, c);
  const BlasMatrix mc = blas_matrix(m, n, c.strides[1], c.strides[2]);
  MB_CHECK(mc.ok && mc.row_major && (batch == 1 || c.strides[0] >= (m - 1) * mc.ld + n),
           "[gemm] c must be row-major (last stride 1) without overlapping rows or batches: a {}, b {}, "
           "c {}", describe(a), describe(b), describe(c));
  MB_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && batch <= INT_MAX && oa.ld <= INT_MAX &&
               ob.ld <= INT_MAX && mc.ld <= INT_MAX,
           "[gemm] a size or leading dimension exceeds cuBLAS's int range: a {}, b {}, c {}",
           describe(a), describe(b), describe(c));

  // C^T (N, M) = op(B) (N, K) @ op(A) (K, M), Note [Row-major GEMM on cuBLAS].
  const cudaDataType_t in_type = blas_type(a.dtype), out_type = blas_type(c.dtype);
  const bool f64 = a.dtype == DType::f64;
  const cublasComputeType_t compute = f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const float alpha32 = static_cast<float>(alpha), beta32 = static_cast<float>(beta);
  const void* alpha_ptr = f64 ? static_cast<const void*>(&alpha) : &alpha32;
  const void* beta_ptr = f64 ? static_cast<const void*>(&beta) : &beta32;
  const long long c_batch_stride = batch == 1 ? 0 : c.strides[0];
  cublasHandle_t handle = cublas_handle();
  // Split-K partial sums stay in f32 too, rather than in a 16-bit C's type: one rounding at the end.
  MB_CUBLAS_CHECK(cublasSetMathMode(
      handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                        CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  MB_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, ob.op, oa.op, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
      alpha_ptr, b.data, in_type, static_cast<int>(ob.ld), ob.batch_stride, a.data, in_type,
      static_cast<int>(oa.ld), oa.batch_stride, beta_ptr, c.data, out_type, static_cast<int>(mc.ld),
      c_batch_stride, static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT));
}

std::string lt_last_refusal() {
  std::lock_guard lock(g_lt_mutex);
  if (!g_not_offered) return g_lt_refusal;
  const NotOffered& n = *g_not_offered;
  return MB_FORMAT("not offered to cuBLASLt: types {}, layout {}, bias and aux {}; c {}",
                   n.types ? "ok" : "not one of f32, f16, bf16 (f32: the bias epilogue only)",
                   n.layout ? "ok" : "not 2-d row-major c within int range",
                   n.vectors ? "ok" : "under-aligned or aux ld not a multiple of 8", describe(n.c));
}

std::int64_t lt_epilogue_calls(LtCall kind) {
  switch (kind) {
    case LtCall::bias: return g_lt_bias.load();
    case LtCall::gelu: return g_lt_gelu.load();
    case LtCall::dgelu: return g_lt_dgelu.load();
  }
  return 0;
}

bool gemm_bias_epilogue() { return epilogue_wanted(); }
void set_gemm_bias_epilogue(bool on) { epilogue_wanted() = on; }

namespace {

// What a cuBLASLt call adds to the product: the epilogue, its bias (or nullptr) and its auxiliary
// matrix (GELU's input, (M, N) row-major with row stride aux_ld; or nullptr).
struct LtEpilogue {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
  std::int64_t aux_ld = 0;
};

// c = a @ b with the epilogue, through cuBLASLt: true when done, false when Lt does not take the
// call (the caller then computes the same another way). a (1, M, K), b (1, K, N), c (1, M, N)
// row-major, one dtype of f32, f16 or bf16; a packed, 16-byte aligned bias and aux.
bool lt_matmul(const StridedView& a, const StridedView& b, const StridedView& c,
               const LtEpilogue& e) {
  const std::int64_t m = c.shape[1], n = c.shape[2], k = a.shape[2];
  // f32 takes only the bias epilogue, which adds exactly: cuBLASLt's GELU and its derivative may
  // use a fast tanh, whose error the derivative magnifies past f32's parity (f32 means f32).
  const bool gelu = e.kind != CUBLASLT_EPILOGUE_BIAS;
  const bool lt_types = a.dtype == b.dtype && a.dtype == c.dtype &&
                        (a.dtype == DType::f16 || a.dtype == DType::bf16 ||
                         (a.dtype == DType::f32 && !gelu));
  const BlasMatrix mc = blas_matrix(m, n, c.strides[1], c.strides[2]);
  const BlasMatrix ma = blas_matrix(m, k, a.strides[1], a.strides[2]);
  const BlasMatrix mb = blas_matrix(k, n, b.strides[1], b.strides[2]);
  const bool lt_layout = k > 0 && a.shape[0] == 1 && b.shape[0] == 1 && mc.ok && mc.row_major &&
                         ma.ok && mb.ok && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX;
  // Lt has no alignment preference for the bias and aux, and its kernels may load them 16 bytes at
  // a time: an under-aligned one (a bias at an odd place in the parameter arena, a one-element
  // bias too) is not offered; aux rows must be a multiple of 8 apart.
  const bool lt_vectors = (e.bias == nullptr || alignment_of(e.bias) >= 16) &&
                          (e.aux == nullptr || (alignment_of(e.aux) >= 16 && e.aux_ld % 8 == 0 &&
                                                e.aux_ld >= n));
  if (!epilogue_wanted()) return false;
  if (!lt_types || !lt_layout || !lt_vectors) {
    std::lock_guard lock(g_lt_mutex);
    g_not_offered = NotOffered{lt_types, lt_layout, lt_vectors, c};
    return false;
  }

  // D^T (N, M) = op(B) (N, K) @ op(A) (K, M), the epilogue over D^T's rows (Note [Row-major GEMM
  // on cuBLAS]): cuBLASLt's first operand is b, its second a.
  const cublasOperation_t op_b = mb.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_a = ma.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cudaDataType_t type = blas_type(c.dtype);
  int device = 0;
  MB_CUDA_CHECK(cudaGetDevice(&device));
  const LtKey key{.device = device,
                  .dtype = c.dtype,
                  .epilogue = static_cast<int>(e.kind),
                  .op_b = static_cast<int>(op_b),
                  .op_a = static_cast<int>(op_a),
                  .m = m,
                  .n = n,
                  .k = k,
                  .ldb = mb.ld,
                  .lda = ma.ld,
                  .ldc = mc.ld,
                  .ld_aux = e.aux_ld,
                  .align_b = alignment_of(b.data),
                  .align_a = alignment_of(a.data),
                  .align_c = alignment_of(c.data),
                  .align_bias = e.bias != nullptr ? alignment_of(e.bias) : 0,
                  .align_aux = e.aux != nullptr ? alignment_of(e.aux) : 0};
  LtDescs d;
  MB_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(d.op, CUBLASLT_MATMUL_DESC_TRANSA, op_b);
  set_desc(d.op, CUBLASLT_MATMUL_DESC_TRANSB, op_a);
  set_desc(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, e.kind);
  if (e.bias != nullptr) set_desc(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, e.bias);
  if (e.aux != nullptr) {
    set_desc(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, e.aux);
    set_desc(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, e.aux_ld);
  }
  // The stored matrices: op N reads (rows, cols) as given, op T their transpose.
  MB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, type, op_b == CUBLAS_OP_N ? n : k,
                                             op_b == CUBLAS_OP_N ? k : n, mb.ld));
  MB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, type, op_a == CUBLAS_OP_N ? k : m,
                                             op_a == CUBLAS_OP_N ? m : k, ma.ld));
  MB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, type, n, m, mc.ld));
  std::size_t workspace_bytes = 0;
  void* workspace = cublas_workspace(&workspace_bytes);

  LtChoice choice;
  {
    std::lock_guard lock(g_lt_mutex);
    auto it = lt_algos().find(key);
    if (it != lt_algos().end()) {
      choice = it->second;
      if (!choice.ok) {  // this call is the last one declined now
        remember_refusal(choice.refusal);
      }
    } else {
      MB_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
      set_pref(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
      // Split-K partial sums in f32, never in a 16-bit output type (as gemm's math mode).
      set_pref(d.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
               static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
      set_pref(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
      set_pref(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
      set_pref(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
      set_pref(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
          cublaslt_handle(), d.op, d.a, d.b, d.c, d.c, d.pref, 1, &result, &found);
      if (status == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
        choice = {.ok = true, .algo = result.algo};
      } else {
        // The statuses that refuse a configuration, as cublasLtMatmul's below; an invalid
        // combination of descriptors can be refused here already.
        MB_CHECK(status == CUBLAS_STATUS_SUCCESS || status == CUBLAS_STATUS_NOT_SUPPORTED ||
                     status == CUBLAS_STATUS_INVALID_VALUE ||
                     status == CUBLAS_STATUS_ARCH_MISMATCH,
                 "[gemm] cublasLtMatmulAlgoGetHeuristic failed: {}",
                 describe_refusal(cublas_status_name(status), key));
        const char* why = status != CUBLAS_STATUS_SUCCESS ? cublas_status_name(status)
                          : found > 0                     ? cublas_status_name(result.state)
                                                          : "no algorithm";
        choice.refusal = describe_refusal(why, key);
        remember_refusal(choice.refusal);
      }
      lt_algos().emplace(key, choice);
    }
  }
  if (!choice.ok) return false;
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t status =
      cublasLtMatmul(cublaslt_handle(), d.op, &one, b.data, d.a, a.data, d.b, &zero, c.data, d.c,
                     c.data, d.c, &choice.algo, workspace, workspace_bytes, current_stream());
  if (status == CUBLAS_STATUS_SUCCESS) {
    (e.kind == CUBLASLT_EPILOGUE_BIAS            ? g_lt_bias
     : e.kind == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ? g_lt_gelu
                                                 : g_lt_dgelu)
        .fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  // Refused after all (the configuration, not the device): this shape takes the other way from now
  // on, and c is overwritten by it. Any other status is a failure that must not pass unseen.
  MB_CHECK(status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE ||
               status == CUBLAS_STATUS_ARCH_MISMATCH,
           "[gemm] cublasLtMatmul failed: {}",
           describe_refusal(cublas_status_name(status), key));
  std::lock_guard lock(g_lt_mutex);
  LtChoice& refused = lt_algos()[key];
  refused.ok = false;
  refused.refusal = describe_refusal(cublas_status_name(status), key);
  remember_refusal(refused.refusal);
  return false;
}

void check_one_product(const char* op, const StridedView& a, const StridedView& b,
                       const StridedView& c) {
  MB_CHECK(a.ndim == 3 && b.ndim == 3 && c.ndim == 3 && c.shape[0] == 1,
           "[{}] expected 3-d views with one batch: a {}, b {}, c {}", op, describe(a), describe(b),
           describe(c));
  MB_CHECK(a.shape[1] == c.shape[1] && b.shape[1] == a.shape[2] && b.shape[2] == c.shape[2],
           "[{}] shapes do not chain: a {} @ b {} -> c {}", op, describe(a), describe(b),
           describe(c));
}

// GELU's input as cuBLASLt's aux matrix wants its leading dimension: pre's row stride (a single
// row's stride is free, so any multiple of 8 at least N serves).
std::int64_t aux_ld(const StridedView& pre) {
  return pre.shape[1] == 1 ? (pre.shape[2] + 7) / 8 * 8 : pre.strides[1];
}

// A (1, M, N) row-major view's rows as a 2-d view, for the element-wise kernels.
StridedView rows_of(const StridedView& v) {
  StridedView r = v;
  r.ndim = 2;
  r.shape[0] = v.shape[1];
  r.shape[1] = v.shape[2];
  r.strides[0] = v.strides[1];
  r.strides[1] = v.strides[2];
  return r;
}

}  // namespace

void gemm_bias(const StridedView& a, const StridedView& b, const StridedView& bias,
               const StridedView& c) {
  check_one_product("gemm_bias", a, b, c);
  const std::int64_t m = c.shape[1], n = c.shape[2];
  MB_CHECK(bias.ndim == 1 && bias.shape[0] == n && bias.dtype == c.dtype,
           "[gemm_bias] bias {} must be ({},) of c's dtype: c {}", describe(bias), n, describe(c));
  if (m == 0 || n == 0) return;
  if ((n == 1 || bias.strides[0] == 1) &&
      lt_matmul(a, b, c, {.kind = CUBLASLT_EPILOGUE_BIAS, .bias = bias.data})) {
    return;
  }
  // Without the epilogue: the bias rows first, then the product added onto them.
  dispatch_float(c.dtype, "gemm_bias", [&]<class T>() {
    bias_rows_kernel<T><<<grid_for(m * n, kThreads), kThreads, 0, current_stream()>>>(
        c.ptr<T>(), c.strides[1], c.strides[2], bias.ptr<T>(), bias.strides[0], m, n);
    MB_CUDA_CHECK_LAUNCH("bias_rows_kernel");
  });
  gemm(a, b, c, 1.0, 1.0);
}

void gemm_bias_gelu(const StridedView& a, const StridedView& b, const StridedView& bias,
                    const StridedView& out, const StridedView& pre) {
  check_one_product("gemm_bias_gelu", a, b, out);
  const std::int64_t m = out.shape[1], n = out.shape[2];
  MB_CHECK(bias.ndim == 1 && bias.shape[0] == n && bias.dtype == out.dtype && pre.ndim == 3 &&
               pre.shape[1] == m && pre.shape[2] == n && pre.dtype == out.dtype &&
               pre.strides[2] == 1 && pre.data != out.data,
           "[gemm_bias_gelu] bias {} and pre {} do not match out {}, or pre is out itself",
           describe(bias), describe(pre), describe(out));
  if (m == 0 || n == 0) return;
  if ((n == 1 || bias.strides[0] == 1) &&
      lt_matmul(a, b, out,
                {.kind = CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                 .bias = bias.data,
                 .aux = pre.data,
                 .aux_ld = aux_ld(pre)})) {
    return;
  }
  gemm_bias(a, b, bias, pre);
  unary(UnaryOp::GeluTanh, rows_of(out), rows_of(pre));
}

void gemm_dgelu(const StridedView& a, const StridedView& b, const StridedView& pre,
                const StridedView& out) {
  check_one_product("gemm_dgelu", a, b, out);
  const std::int64_t m = out.shape[1], n = out.shape[2];
  MB_CHECK(pre.ndim == 3 && pre.shape[1] == m && pre.shape[2] == n && pre.dtype == out.dtype &&
               pre.strides[2] == 1 && pre.data != out.data,
           "[gemm_dgelu] pre {} does not match out {}, or is out itself", describe(pre),
           describe(out));
  if (m == 0 || n == 0) return;
  if (lt_matmul(a, b, out,
                {.kind = CUBLASLT_EPILOGUE_DGELU,
                 .aux = pre.data,
                 .aux_ld = aux_ld(pre)})) {
    return;
  }
  gemm(a, b, out, 1.0, 0.0);
  binary(BinaryOp::GeluTanhBackward, rows_of(out), rows_of(pre), rows_of(out));
}

}  // namespace microbatch::kernels::cuda
