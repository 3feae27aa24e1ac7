// GEMM for the linear layers: a thin, cached wrapper over oneDNN's matmul primitive.
//
// Glossary: M rows (B*T tokens), N output features, K input features (the contraction).
//
//   C (M, N)  =  op(A) (M, K) * op(B) (K, N)  [+ bias (N) broadcast over rows]  [+ C]
//
// All matrices are row-major with a row stride (lda/ldb/ldc, in elements, unit column stride),
// so views such as one head of a (B, T, E) activation or a column slice need no copy.
//   op(A) = A        A stored (M, K), row stride lda >= K
//   op(A) = A^T      A stored (K, M), row stride lda >= M        (trans_a)
//   op(B) = B        B stored (K, N), row stride ldb >= N
//   op(B) = B^T      B stored (N, K), row stride ldb >= K        (trans_b: the linear layout)
// The three products of a linear layer y = x W^T + b, x (M, in), W (out, in):
//   forward    y  (M, out)   = x (M, in) * W^T                   trans_b, bias
//   input grad dx (M, in)    = dy (M, out) * W (out, in)         plain
//   weight grad dW (out, in) += dy^T (out, M) * x (M, in)         trans_a, accumulate
//
// Element types: f32 in, f32 out; or bf16 in (A and B), f32 bias, and f32 out (C) or bf16 out
// (C_bf16: the f32 result rounded once to nearest even as it is stored, as PyTorch's bf16
// linear). Accumulation is always f32 (a product of two bf16 values is exact in f32). Which code
// runs bf16 (oneDNN 2.6, checked with ONEDNN_VERBOSE and ONEDNN_MAX_CPU_ISA): AVX512-BF16 (Zen 4+,
// Cooper Lake+) the native brgemm kernels (vdpbf16ps, which flushes subnormals to zero); AVX512
// without BF16 an emulated jit GEMM; below AVX512 (AVX2: Zen 2 and 3, Intel's client cores)
// oneDNN has no bf16 matmul and rejects the configuration, so A and B are widened to f32 (exact)
// and the f32 product runs, the output rounded once as above (gemm_bf16_native() says which).
//
// Float32 products on x86-64 CPUs without AVX-512 (AVX2 + FMA: Zen 2 and 3, Intel's client
// cores) run on attn's own kernel instead (gemm_rows.hpp): there oneDNN runs its jit sgemm,
// whose bits for a row depend on how many rows come with it, which broke every "same bits for
// any thread count" promise below; attn's kernel computes each element as one FMA chain over k
// in order, so a row's bits depend on nothing else.
//
// Threads: `threads` (resolve Context::threads first, >= 1). A plain or trans_b product of at
// least 32 rows per thread is cut into that many slices of rows (multiples of 16), each a
// single-thread oneDNN primitive, in one OpenMP region: even work per thread, and a slice's rows
// have the single-thread product's bits (matmul.cpp has the figures). On attn's own kernel
// trans_a products are cut the same way. A trans_a product on oneDNN (a weight gradient) with a
// contraction longer than 512 runs as single-thread primitives on chunks of ~512 rows of K, each
// into its own float partial, summed in chunk order (at most 32 chunks, 32 MB of partials), when
// there are no more threads than chunks: its bits depend on the shape alone. Any other product
// runs on
// oneDNN's own threads: `threads` is applied with omp_set_num_threads around primitive creation
// and execution and restored afterwards, and is part of the cache key, because oneDNN fixes its
// work partition when the primitive is created. Call from outside an OpenMP parallel region
// (inside one, everything runs on the calling thread).
// Determinism: for a fixed `threads` results are bitwise reproducible run to run. Across thread
// counts oneDNN 2.6 gives no promise, and we probed it (1 vs 2 threads,
// tests/test_kernels_matmul_cpu.cpp and a sweep M, N in 1..512, K in 1e3..1e5): the plain and
// trans_b products (forward x W^T, input grad dy W) were identical on every probed shape; on
// oneDNN's threads the trans_a product (weight grad dy^T x) is split along K by oneDNN when the
// output is small next to the contraction and then differs in the last bits, e.g. (M, N, K) =
// (512, 64, 4096) or (16, 16, 20000). The chunks above (session 24) make every trans_a product
// with K > 512 the same bits on any thread count up to its number of chunks (K / 512, at most
// 32); K <= 512, an output of more than 4M elements, or more threads than chunks still run on
// oneDNN's threads.
//
// A few rows times a small weight (M <= 4, at most 2^15 multiply-adds, the linear forward's
// layout, f32) skip the primitive and go through oneDNN's sgemm on the calling thread: its cost
// per call is a fraction of the primitive's, which dominated a decoder step at batch 1 (matmul.cpp
// has the figures). Such a row's bits differ from the same row inside a larger product.
//
// Cache: one primitive per (shape, strides, flags, dtype, threads), in a mutex-protected map;
// one engine for the process, one stream per calling thread. Kernels never throw on user input:
// when oneDNN rejects a configuration, a plain loop computes the same product.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attn::cpu {

enum class GemmType : uint8_t {
  kF32,   // A, B float
  kBF16,  // A, B bfloat16 (uint16_t bits); C and bias float
};

struct GemmArgs {
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* B = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  float* C = nullptr;
  int64_t ldc = 0;
  // When set (GemmType::kBF16 only), the result goes here as bf16 instead of to C: the f32
  // accumulator (bias and, with accumulate, the old value added in f32) rounded once to nearest
  // even when stored, with no f32 buffer and no separate rounding pass.
  uint16_t* C_bf16 = nullptr;
  const float* bias = nullptr;  // (N) or null
  bool accumulate = false;      // C += product (beta = 1) instead of C = product
  GemmType type = GemmType::kF32;
  // B is a parameter's own tensor, alive and unchanged while a GemmFixedPackingScope lives on
  // the calling thread (set by nn::Linear for its weight): the row-exact kernel may keep its
  // packing from call to call.
  bool b_fixed = false;
};

// While one lives on the calling thread, the row-exact kernel (gemm_rows.hpp, CPUs without
// AVX-512) keeps op(B) packed between calls for products marked b_fixed, found by B's address
// and layout: a decoder's weights are packed once per generation instead of once per step, where
// packing took 46% of greedy decoding at batch 1 (perf, Zen 3). Whoever opens one promises that
// no b_fixed B changes or is freed until it ends (generation: the model is in eval mode and no
// optimiser runs). Nestable; the outermost one's end frees the packings. Other threads' products
// are not affected.
class GemmFixedPackingScope {
 public:
  GemmFixedPackingScope();
  ~GemmFixedPackingScope();
  GemmFixedPackingScope(const GemmFixedPackingScope&) = delete;
  GemmFixedPackingScope& operator=(const GemmFixedPackingScope&) = delete;
};

// C = op(A) op(B) (+ bias) (+ C), on `threads` OpenMP threads (>= 1).
void gemm(const GemmArgs& args, int threads);

// Work that shares gemm()'s parallel region: run(data, part, parts) once for each part in
// [0, parts), on the region's threads after their slices of the product (each thread its own
// parts first, then those a slower thread has not started: kernels/cpu/parallel_for.hpp's
// TaskShares). A task splits its own work by part, and a part's result must not depend on the
// thread that runs it or on `parts`. Sharing the region saves a second region's start and end
// barrier and the serial code between the two, and the parts even out the threads' finish.
struct RegionTask {
  void (*run)(void* data, int part, int parts) = nullptr;
  void* data = nullptr;
};

// Work on the product's own rows: run(data, begin, end) for rows [begin, end) of the output, by
// the thread that has just computed them (while they are in its cache), once for every row;
// rows are handed out in pieces of any size, and a row's result must not depend on the piece.
// An elementwise epilogue (ReLU, a mask) runs here instead of in a pass of its own.
struct RowTask {
  void (*run)(void* data, int64_t begin, int64_t end) = nullptr;
  void* data = nullptr;
};

// gemm(args, threads), `rows` on each piece of rows after it, and `task` in the same region: in
// parts when the product is cut into slices, else the rows as (0, M) and the task as (0, 1) on
// the calling thread after the product.
void gemm_then(const GemmArgs& args, int threads, RegionTask task, RowTask rows = {});

// The same product as gemm(), cut into panels of about M/16 output rows (multiples of 16, the
// cut fixed by M alone) that `threads` OpenMP threads take on a dynamic schedule, each panel one
// single-thread oneDNN call. gemm()'s threads split the work evenly and wait for each other: when
// another process or pool keeps part of a core busy (OpenBLAS's worker spins for ~0.1 s after every
// call it serves, e.g. in a PyTorch loop whose other layers use OpenBLAS), the thread sharing that
// core holds all the others up, and two threads ran no faster than one. Here the unhindered thread
// takes more panels. Results depend on M's cut only, so they are the same for any thread count
// (not always bitwise gemm()'s: oneDNN's blocking may differ between a panel and the whole).
void gemm_panels(const GemmArgs& args, int threads);

// db (N) (+)= sum over the M rows of dy (M, N) (row stride lddy): the bias gradient, summed in
// double in a fixed order (row by row), so it is the same for any thread count. With accumulate
// the sum is rounded to float and then added to db in float, bitwise a separate add of the result.
// Blocks of 32 columns run on up to `threads` OpenMP threads (large enough sums only).
void column_sum(const float* dy, int64_t M, int64_t N, int64_t lddy, float* db, bool accumulate,
                int threads = 1);
// The same for bfloat16 dy (uint16_t bits): each value widened exactly, summed in double, and
// db stays float (the caller rounds it to bf16 once).
void column_sum(const uint16_t* dy, int64_t M, int64_t N, int64_t lddy, float* db, bool accumulate,
                int threads = 1);

// column_sum's blocks of 32 columns that belong to `part` of `parts` (contiguous ranges of
// blocks, as column_sum's threads take them): run by every part, the same bits as column_sum.
// For a RegionTask that adds the bias gradient to a product's region.
void column_sum_part(const float* dy, int64_t M, int64_t N, int64_t lddy, float* db,
                     bool accumulate, int part, int parts);
void column_sum_part(const uint16_t* dy, int64_t M, int64_t N, int64_t lddy, float* db,
                     bool accumulate, int part, int parts);

// Tests only: while on, every gemm() runs the plain-loop fallback that otherwise serves the
// configurations oneDNN rejects (so that path stays tested on CPUs where oneDNN takes all).
void gemm_force_fallback(bool on);
// Tests and benchmarks only: which kernel computes f32 products. kAuto: attn's row-exact kernel
// (gemm_rows.hpp) on CPUs without AVX-512, else oneDNN; kRows: attn's wherever the CPU has AVX2 +
// FMA (so that AVX-512 machines test it); kOneDnn: oneDNN's everywhere (its speed beside attn's
// on the same machine; its bits then depend on M below AVX-512). ATTN_GEMM_F32=onednn|rows sets it
// at start (A/B runs of whole programs).
enum class GemmF32Kernel : uint8_t { kAuto, kOneDnn, kRows };
void gemm_set_f32_kernel(GemmF32Kernel kernel);
// Tests and benchmarks only: how a trans_a product on oneDNN (a weight gradient) runs on several
// threads: in chunks of the contraction with the bits fixed by the shape (kChunksOfK, the
// default; matmul.cpp says how), or on oneDNN's threads (kOneDnn; ATTN_GEMM_WGRAD=onednn at start).
enum class WgradCut : uint8_t { kOneDnn, kChunksOfK };
void gemm_set_wgrad_cut(WgradCut cut);

// Tests only: while on, every bf16 gemm() widens its inputs and runs the f32 product, as on a
// CPU where oneDNN has no bf16 matmul (so that path stays tested on CPUs that have one).
void gemm_force_widened_bf16(bool on);
// Tests only: while on, widened bf16 products (above, or on a CPU without a bf16 matmul) widen
// their whole inputs first and run the f32 product (gemm_widened), as CPUs without AVX2 do,
// instead of widening inside the row-exact kernel's pieces (gemm_rows.hpp).
void gemm_force_widened_whole_bf16(bool on);

// Whether oneDNN multiplies bf16 matrices natively on this CPU (AVX-512 and up). When false, bf16
// products are f32 products of the widened inputs: no faster than f32, plus the conversions.
bool gemm_bf16_native();

// Number of primitives in the cache (tests and benchmarks), and a way to empty it.
size_t gemm_cache_size();
void gemm_cache_clear();

}  // namespace attn::cpu
