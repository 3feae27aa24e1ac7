// GEMM through cuBLASLt (kernels.hpp has the contract). Plans are cached per thread by GemmKey:
// creating descriptors and asking the heuristic costs tens of microseconds, as much as a small
// matmul, and a training step repeats the same shapes every step. float32 runs without TF32 (the
// CPU's precision); bf16 accumulates in float32.
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/gemm_plan.hpp"
#include "kernels/cuda/kernels.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "attn/core/error.hpp"

#include <memory>
#include <unordered_map>
#include <utility>

namespace attn::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's own recommendation for Hopper

void check_lt(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error("cuda::gemm",
                fmt::format("cuBLASLt call {} failed: status {}", call, static_cast<int>(s)));
}
#define ATTN_LT(call) check_lt((call), #call)

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// Per thread: a handle, a workspace, the plans. The workspace is shared by the thread's calls,
// which are ordered when they go to one stream; callers that use several streams from one thread
// at once must synchronise between them (the backend runs one stream per Context and thread).
struct ThreadState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::unordered_map<GemmKey, std::unique_ptr<Plan>, GemmKeyHash> plans;
  ThreadState() {
    ATTN_LT(cublasLtCreate(&handle));
    ATTN_CUDA_CHECK("cuda::gemm", cudaMalloc(&workspace, kWorkspaceBytes));
  }
};

// Never destroyed: at process exit the CUDA runtime may be torn down before thread-local
// destructors run, and freeing then can fail or crash; the driver reclaims everything anyway.
ThreadState& thread_state() {
  thread_local ThreadState* s = new ThreadState;
  return *s;
}

std::unique_ptr<Plan> make_plan(cublasLtHandle_t handle, const GemmArgs& g) {
  auto p = std::make_unique<Plan>();
  const cudaDataType_t t = g.type == GemmType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  ATTN_LT(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const ColumnMajorGemm c = column_major(g);
  const cublasOperation_t op_first = c.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = c.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
  ATTN_LT(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                         sizeof(op_first)));
  ATTN_LT(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                         sizeof(op_second)));
  if (g.bias != nullptr) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    ATTN_LT(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  }
  ATTN_LT(cublasLtMatrixLayoutCreate(&p->a, t, static_cast<uint64_t>(c.first_rows),
                                     static_cast<uint64_t>(c.first_cols), g.ldb));
  ATTN_LT(cublasLtMatrixLayoutCreate(&p->b, t, static_cast<uint64_t>(c.second_rows),
                                     static_cast<uint64_t>(c.second_cols), g.lda));
  ATTN_LT(cublasLtMatrixLayoutCreate(&p->c, t, static_cast<uint64_t>(c.m),
                                     static_cast<uint64_t>(c.n), g.ldc));
  if (g.batch > 1) {
    const int32_t count = static_cast<int32_t>(g.batch);
    const std::pair<cublasLtMatrixLayout_t, int64_t> layouts[] = {
        {p->a, g.stride_b}, {p->b, g.stride_a}, {p->c, g.stride_c}};  // p->a holds B (see above)
    for (const auto& [layout, stride] : layouts) {
      ATTN_LT(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                               sizeof(count)));
      ATTN_LT(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                               &stride, sizeof(stride)));
    }
  }
  cublasLtMatmulPreference_t pref = nullptr;
  ATTN_LT(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = kWorkspaceBytes;
  ATTN_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                               sizeof(ws)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->a, p->b, p->c, p->c,
                                                          pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || found == 0)
    throw Error("cuda::gemm", fmt::format("cuBLASLt has no algorithm for M={} N={} K={} ({})", g.M,
                                          g.N, g.K, g.type == GemmType::kF32 ? "f32" : "bf16"));
  p->algo = result.algo;
  return p;
}

}  // namespace

void gemm(const GemmArgs& g, StreamHandle stream) {
  const char* op = "cuda::gemm";
  check(g.M >= 0 && g.N >= 0 && g.K >= 0, op, "negative size M={} N={} K={}", g.M, g.N, g.K);
  if (g.M == 0 || g.N == 0) return;
  // Leading dimensions of the stored matrices (row strides), at least their row lengths.
  const int64_t a_cols = g.trans_a ? g.M : g.K, b_cols = g.trans_b ? g.K : g.N;
  check(g.batch >= 1 && g.batch < (int64_t{1} << 31) && (g.batch == 1 || g.bias == nullptr), op,
        "batch {} with{} bias: expected 1 <= batch < 2^31, and no bias with a batch", g.batch,
        g.bias == nullptr ? "out" : "");
  check(g.lda >= std::max<int64_t>(a_cols, 1) && g.ldb >= std::max<int64_t>(b_cols, 1) &&
            g.ldc >= g.N,
        op, "leading dimensions lda={} ldb={} ldc={} too small for M={} N={} K={}", g.lda, g.ldb,
        g.ldc, g.M, g.N, g.K);
  ThreadState& ts = thread_state();
  const GemmKey key = gemm_key(g);
  auto it = ts.plans.find(key);
  if (it == ts.plans.end()) it = ts.plans.emplace(key, make_plan(ts.handle, g)).first;
  Plan& p = *it->second;
  if (g.bias != nullptr)
    ATTN_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                           sizeof(g.bias)));
  ATTN_LT(cublasLtMatmul(ts.handle, p.desc, &g.alpha, g.B, p.a, g.A, p.b, &g.beta, g.C, p.c, g.C,
                         p.c, &p.algo, ts.workspace, kWorkspaceBytes,
                         static_cast<cudaStream_t>(stream)));
}

}  // namespace attn::cuda
