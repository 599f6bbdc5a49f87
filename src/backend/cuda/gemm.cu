// cuBLASLt GEMM (row-major through the column-major transpose identity), its plan cache, and the
// scratch / deferred-error helpers declared in gemm.cuh.
//
// Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T, and a row-major matrix
// with leading dim ld is, read column-major, its own transpose with the same ld. So cuBLASLt gets
// (m, n, k) = (N, M, K), its "A" is our B and its "B" is our A, with the transpose flags carried over.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "backend/cuda/gemm.cuh"
#include "backend/cuda/invariant.h"
#include "core/cuda_graph.h"
#include "core/determinism.h"

namespace mt::cuda {

namespace {

// Largest power of two (at most 256) that divides the address: the heuristic must not pick an
// algorithm that needs more alignment than a row slice of a tensor gives it.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  const uintptr_t low = a & (~a + 1);
  return low >= 256 ? 256u : uint32_t(low);
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

void destroy(Plan& p) {
  cublasLtMatrixLayoutDestroy(p.a);
  cublasLtMatrixLayoutDestroy(p.b);
  cublasLtMatrixLayoutDestroy(p.c);
  cublasLtMatmulDescDestroy(p.desc);
}

// trans_a, trans_b, M, N, K, lda, ldb, ldc, c dtype, alignment of A, B, C, operand dtype, pinned (the
// batch-invariant mode's algorithm, below)
using PlanKey = std::array<int64_t, 14>;
// N, K, c dtype, operand dtype: the batch-invariant mode's algorithm serves every M (and leading dims) of these.
using PinKey = std::array<int64_t, 4>;

// Per-expert GEMMs see a new row count almost every step, so the cache is bounded: past this many
// entries it is emptied and refilled (a heuristic query costs tens of microseconds).
constexpr size_t kMaxPlans = 4096;

class PlanCache {
 public:
  std::mutex mu;
  std::map<PlanKey, Plan> plans;
  std::map<PinKey, cublasLtMatmulAlgo_t> pinned;  // never cleared: the same M-free choice every time
  void clear() {
    for (auto& [key, p] : plans) destroy(p);
    plans.clear();
  }
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache;  // never destroyed: cuBLASLt may be gone at exit
  return *cache;
}

std::string describe(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                     DType c_dtype) {
  return str("GEMM C[", M, ", ", N, "] (", dtype_name(c_dtype), ", ldc ", ldc, ") = ", trans_a ? "A^T" : "A", " @ ",
             trans_b ? "B^T" : "B", " with K = ", K, ", lda ", lda, ", ldb ", ldb);
}

// With pinned, the plan runs that algorithm (checked for this M) instead of the heuristic's choice for this M.
// With unsplit, the heuristic's first algorithm that runs with no split of K (split-K 1, no reduction) is taken:
// each element of C is then one CTA's sum over K in the algorithm's fixed order.
Plan make_plan(const char* op, const std::string& what, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               int64_t lda, int64_t ldb, int64_t ldc, cudaDataType_t ab_type, cudaDataType_t c_type, uint32_t align_a,
               uint32_t align_b, uint32_t align_c, const cublasLtMatmulAlgo_t* pinned = nullptr,
               bool unsplit = false) {
  const std::string ctx = str(op, ": ", what);
  Plan p;
  MT_CUBLAS_CHECK(ctx, cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLASLt's A is our B, its B is our A (see the file comment).
  const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  MT_CUBLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MT_CUBLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  // Layouts describe the stored (column-major) matrices before the transpose is applied.
  const uint64_t a_rows = trans_b ? uint64_t(K) : uint64_t(N), a_cols = trans_b ? uint64_t(N) : uint64_t(K);
  const uint64_t b_rows = trans_a ? uint64_t(M) : uint64_t(K), b_cols = trans_a ? uint64_t(K) : uint64_t(M);
  MT_CUBLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&p.a, ab_type, a_rows, a_cols, ldb));
  MT_CUBLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&p.b, ab_type, b_rows, b_cols, lda));
  MT_CUBLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&p.c, c_type, uint64_t(N), uint64_t(M), ldc));
  if (pinned) {
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t st = cublasLtMatmulAlgoCheck(cublaslt(), p.desc, p.a, p.b, p.c, p.c, pinned, &check);
    if (st != CUBLAS_STATUS_SUCCESS || check.workspaceSize > cublaslt_workspace_bytes()) {
      destroy(p);
      MT_THROW(ctx, ": the batch-invariant mode's cuBLASLt algorithm for this N and K cannot run M = ", M,
               " (check status ", int(st), ", workspace ", check.workspaceSize,
               " bytes); MOETRAIN_INVARIANT_GEMM=wmma runs the mode's own GEMM instead");
    }
    p.algo = *pinned;
    return p;
  }

  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = cublaslt_workspace_bytes();
  MT_CUBLAS_CHECK(
      ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // Our B is cuBLASLt's A and vice versa; C and D share one layout (and, but for gemm_add, one buffer);
  // align_c is the smaller alignment of the two.
  MT_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b,
                                                            sizeof(align_b)));
  MT_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a,
                                                            sizeof(align_a)));
  MT_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                            sizeof(align_c)));
  MT_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                            sizeof(align_c)));
  std::array<cublasLtMatmulHeuristicResult_t, 16> results{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublaslt(), p.desc, p.a, p.b, p.c, p.c, pref,
                                                           unsplit ? int(results.size()) : 1, results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy(p);
    MT_THROW(ctx, ": cuBLASLt has no algorithm for it (heuristic status ", int(st), ", ", found,
             " results; pointer alignment A ", align_a, ", B ", align_b, ", C ", align_c, " bytes)");
  }
  if (!unsplit) {
    p.algo = results[0].algo;
    return p;
  }
  for (int i = 0; i < found; ++i) {
    cublasLtMatmulAlgo_t algo = results[size_t(i)].algo;
    const uint32_t one = 1, none = CUBLASLT_REDUCTION_SCHEME_NONE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof(none)) !=
            CUBLAS_STATUS_SUCCESS)
      continue;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(cublaslt(), p.desc, p.a, p.b, p.c, p.c, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= cublaslt_workspace_bytes()) {
      p.algo = algo;
      return p;
    }
  }
  destroy(p);
  MT_THROW(ctx, ": none of cuBLASLt's ", found, " algorithms for it runs without splitting K (the batch-invariant "
           "mode needs one); MOETRAIN_INVARIANT_GEMM=wmma runs the mode's own GEMM instead");
}

// The batch-invariant mode's dense forward GEMM (C = A B^T): "cublaslt" (the default) runs one cuBLASLt algorithm
// for every M of an (N, K) shape, chosen once at pin_rows() rows with K unsplit, so a row's bits do not depend on how
// many rows share the call; "wmma" runs invariant.cuh's own kernel. MOETRAIN_INVARIANT_GEMM, read at every call.
bool invariant_gemm_on_cublaslt() {
  const char* v = std::getenv("MOETRAIN_INVARIANT_GEMM");
  if (!v || !*v || std::string(v) == "cublaslt") return true;
  if (std::string(v) == "wmma") return false;
  MT_THROW("MOETRAIN_INVARIANT_GEMM is '", v, "'; allowed: cublaslt (the default) or wmma");
}

// The row count the mode's algorithm is chosen at (MOETRAIN_INVARIANT_GEMM_ROWS, default 1024; read once): the
// choice serves every M, decode batches and training micro-batches alike.
int64_t pin_rows() {
  static const int64_t rows = [] {
    const char* v = std::getenv("MOETRAIN_INVARIANT_GEMM_ROWS");
    if (!v || !*v) return int64_t(1024);
    char* end = nullptr;
    const long long r = std::strtoll(v, &end, 10);
    MT_CHECK(end && *end == 0 && r >= 1 && r <= (1 << 24), "MOETRAIN_INVARIANT_GEMM_ROWS is '", v,
             "'; allowed: an integer in [1, 16777216]");
    return int64_t(r);
  }();
  return rows;
}

// The GEMM for both operand types: A and B are ab_dtype (bf16, or f32 with CUBLAS_COMPUTE_32F, which
// cuBLASLt runs as true fp32, not TF32), C is bf16 or f32. With C_src (gemm_add) the epilogue reads
// beta * C_src and writes C (cuBLASLt's separate C and D, same layout); otherwise C is both.
void gemm_any(const char* op, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
              const void* B, int64_t ldb, DType ab_dtype, float beta, void* C, DType c_dtype, int64_t ldc, float alpha,
              const void* C_src = nullptr) {
  if (!C_src) C_src = C;
  MT_CHECK(c_dtype == DType::BF16 || c_dtype == DType::F32, op, ": GEMM output must be bf16 or f32, got ",
           dtype_name(c_dtype));
  MT_CHECK(M >= 0 && N >= 0 && K >= 0, op, ": ", describe(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_dtype),
           " has a negative size");
  if (M == 0 || N == 0) return;
  const size_t c_elem = c_dtype == DType::F32 ? 4 : 2;
  MT_CHECK(ldc >= N, op, ": ", describe(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_dtype), ": ldc < N");
  MT_CHECK(C != nullptr, op, ": ", describe(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_dtype), ": C is null");
  if (K == 0) {
    MT_CHECK(beta == 0.0f || beta == 1.0f, op, ": GEMM with K = 0 supports beta 0 or 1, got ", beta);
    if (beta == 0.0f)
      MT_CUDA_CHECK(op, cudaMemset2DAsync(C, size_t(ldc) * c_elem, 0, size_t(N) * c_elem, size_t(M), stream()));
    else if (C_src != C)
      MT_CUDA_CHECK(op, cudaMemcpy2DAsync(C, size_t(ldc) * c_elem, C_src, size_t(ldc) * c_elem, size_t(N) * c_elem,
                                          size_t(M), cudaMemcpyDeviceToDevice, stream()));
    return;
  }
  MT_CHECK(A != nullptr && B != nullptr, op, ": ", describe(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_dtype),
           ": A or B is null");
  MT_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N), op, ": ",
           describe(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_dtype), ": a leading dim is smaller than its row");
  uint32_t align_a = alignment_of(A), align_b = alignment_of(B),
           align_c = std::min(alignment_of(C), alignment_of(C_src));
  // The batch-invariant mode's forward C = A B^T: one algorithm for every M (pinned above), at 16-byte alignment;
  // operands less aligned than that, or MOETRAIN_INVARIANT_GEMM=wmma, take invariant.cuh's kernel.
  bool pinned = false;
  if (batch_invariant() && !trans_a && trans_b) {
    if (!invariant_gemm_on_cublaslt() || std::min({align_a, align_b, align_c}) < 16) {
      invariant_gemm_nt(op, M, N, K, A, lda, B, ldb, ab_dtype, alpha, beta, C_src, C, c_dtype, ldc);
      return;
    }
    pinned = true;
    align_a = align_b = align_c = 16;
  }
  const cudaDataType_t c_type = c_dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  const cudaDataType_t ab_type = ab_dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  const PlanKey key{trans_a, trans_b, M,       N,       K,       lda, ldb, ldc, int64_t(c_dtype), align_a, align_b,
                    align_c, int64_t(ab_dtype), pinned};
  // The lock is held through the (asynchronous, cheap) matmul call so that no other thread can clear
  // the cache while its descriptors are in use.
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  auto it = cache.plans.find(key);
  if (it == cache.plans.end()) {
    if (cache.plans.size() >= kMaxPlans) cache.clear();
    const std::string what = describe(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_dtype) +
                             (ab_dtype == DType::F32 ? " (f32 operands)" : "");
    const cublasLtMatmulAlgo_t* algo = nullptr;
    if (pinned) {
      const PinKey pin{N, K, int64_t(c_dtype), int64_t(ab_dtype)};
      auto p = cache.pinned.find(pin);
      if (p == cache.pinned.end()) {
        const int64_t R = pin_rows();
        Plan ref = make_plan(op, describe(false, true, R, N, K, lda, ldb, ldc, c_dtype) + " (batch-invariant choice)",
                             false, true, R, N, K, lda, ldb, ldc, ab_type, c_type, 16, 16, 16, nullptr, true);
        p = cache.pinned.emplace(pin, ref.algo).first;
        destroy(ref);
      }
      algo = &p->second;
    }
    it = cache.plans
             .emplace(key, make_plan(op, what, trans_a, trans_b, M, N, K, lda, ldb, ldc, ab_type, c_type, align_a,
                                     align_b, align_c, algo))
             .first;
  }
  const Plan& plan = it->second;
  const cublasStatus_t st =
      cublasLtMatmul(cublaslt(), plan.desc, &alpha, B, plan.a, A, plan.b, &beta, C_src, plan.c, C, plan.c, &plan.algo,
                     cublaslt_workspace(), cublaslt_workspace_bytes(), stream());
  if (st != CUBLAS_STATUS_SUCCESS)
    MT_THROW(op, ": ", describe(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_dtype),
             ": cublasLtMatmul failed with cublas status ", int(st));
}

}  // namespace

void gemm(const char* op, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const __nv_bfloat16* A,
          int64_t lda, const __nv_bfloat16* B, int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc,
          float alpha) {
  gemm_any(op, trans_a, trans_b, M, N, K, A, lda, B, ldb, DType::BF16, beta, C, c_dtype, ldc, alpha);
}

void gemm(const char* op, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc, float alpha) {
  gemm_any(op, trans_a, trans_b, M, N, K, A, lda, B, ldb, DType::F32, beta, C, c_dtype, ldc, alpha);
}

void gemm_add(const char* op, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const __nv_bfloat16* A,
              int64_t lda, const __nv_bfloat16* B, int64_t ldb, const void* C, void* D, DType dtype, int64_t ldc) {
  MT_CHECK(C != nullptr, op, ": gemm_add's C (the addend) is null");
  gemm_any(op, trans_a, trans_b, M, N, K, A, lda, B, ldb, DType::BF16, 1.0f, D, dtype, ldc, 1.0f, C);
}

void* DeviceScratch::get(size_t bytes, const char* op) {
  if (bytes == 0) bytes = 1;
  if (bytes > bytes_) {
    if (p_) MT_CUDA_CHECK(op, cudaFree(p_));  // waits for the device, so no kernel still uses it
    p_ = nullptr;
    bytes_ = 0;
    MT_CUDA_CHECK(op, cudaMalloc(&p_, bytes));
    bytes_ = bytes;
    cuda_graph::bump_epoch();  // graphs captured over the old buffer are stale
  }
  return p_;
}

void DeferredError::init(const char* op) {
  if (dev_) return;
  MT_CUDA_CHECK(op, cudaMalloc(reinterpret_cast<void**>(&dev_), sizeof(unsigned long long)));
  MT_CUDA_CHECK(op, cudaMemsetAsync(dev_, 0xff, sizeof(unsigned long long), stream()));
  void* host = nullptr;
  MT_CUDA_CHECK(op, cudaMallocHost(&host, sizeof(unsigned long long)));
  host_ = static_cast<volatile unsigned long long*>(host);
  *host_ = kNone;
}

unsigned long long* DeferredError::device_word(const char* op) {
  init(op);
  return dev_;
}

void DeferredError::publish(const char* op) {
  init(op);
  MT_CUDA_CHECK(op, cudaMemcpyAsync(const_cast<unsigned long long*>(host_), dev_, sizeof(unsigned long long),
                                    cudaMemcpyDeviceToHost, stream()));
}

bool DeferredError::take(unsigned long long* key, const char* op) {
  init(op);
  if (*host_ == kNone) return false;
  // Let every queued copy land before resetting, so the same error is not reported twice.
  sync(op);
  *key = *host_;
  MT_CUDA_CHECK(op, cudaMemsetAsync(dev_, 0xff, sizeof(unsigned long long), stream()));
  sync(op);
  *host_ = kNone;
  return true;
}

}  // namespace mt::cuda
