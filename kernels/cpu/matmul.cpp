// oneDNN matmul wrapper; see matmul.hpp for the math, layouts and threading contract.
#include "kernels/cpu/matmul.hpp"

#include "attn/core/dtype.hpp"
#include "kernels/cpu/gemm_rows.hpp"
#include "kernels/cpu/parallel_for.hpp"
#include "kernels/cpu/scratch.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace attn::cpu {
namespace {

// Loops compiled per target like the bulk conversions in core/tensor.cpp: the small products and
// the column sums below. Left out under AddressSanitizer (ifunc resolvers run before its runtime
// starts) and for clang: the plain loop there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define ATTN_MATMUL_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTN_MATMUL_CLONES
#endif

// Everything that changes the primitive oneDNN builds. Data pointers are not part of it: they
// are bound at execution through memory objects.
struct GemmKey {
  int64_t M, N, K, lda, ldb, ldc;
  int threads;
  uint8_t type;
  bool trans_a, trans_b, has_bias, accumulate, c_bf16;
  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    // FNV-1a style mixing of the fields; collisions only cost an equality compare.
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(static_cast<uint64_t>(k.M));
    mix(static_cast<uint64_t>(k.N));
    mix(static_cast<uint64_t>(k.K));
    mix(static_cast<uint64_t>(k.lda));
    mix(static_cast<uint64_t>(k.ldb));
    mix(static_cast<uint64_t>(k.ldc));
    mix(static_cast<uint64_t>(k.threads));
    mix(k.type | (k.trans_a << 8) | (k.trans_b << 9) | (k.has_bias << 10) | (k.accumulate << 11) |
        (k.c_bf16 << 12));
    return static_cast<size_t>(h);
  }
};

struct GemmPlan {
  dnnl::matmul primitive;
  dnnl::memory::desc a_md, b_md, c_md, bias_md, scratch_md;
};

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);  // thread-safe static init
  return engine;
}

// A CPU stream carries no state between executions, but oneDNN does not document streams as
// safe to share between threads, so each calling thread gets its own.
dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

// The calling thread's scratchpad, grown to the largest any plan asked for, 64-byte aligned.
void* scratchpad(size_t bytes) {
  thread_local std::vector<std::byte> buffer;
  return grown_aligned(buffer, bytes);
}

std::mutex cache_mutex;
std::unordered_map<GemmKey, std::shared_ptr<GemmPlan>, GemmKeyHash> cache;

using dims = dnnl::memory::dims;
using dt = dnnl::memory::data_type;

std::shared_ptr<GemmPlan> make_plan(const GemmKey& k) {
  const dt in = k.type == static_cast<uint8_t>(GemmType::kBF16) ? dt::bf16 : dt::f32;
  auto plan = std::make_shared<GemmPlan>();
  // oneDNN's matmul is src (M, K) x weights (K, N) -> dst (M, N) with arbitrary strides, so
  // each transposition is just a swapped stride pair.
  plan->a_md = dnnl::memory::desc(dims{k.M, k.K}, in, k.trans_a ? dims{1, k.lda} : dims{k.lda, 1});
  plan->b_md = dnnl::memory::desc(dims{k.K, k.N}, in, k.trans_b ? dims{1, k.ldb} : dims{k.ldb, 1});
  plan->c_md = dnnl::memory::desc(dims{k.M, k.N}, k.c_bf16 ? dt::bf16 : dt::f32, dims{k.ldc, 1});
  if (k.has_bias) plan->bias_md = dnnl::memory::desc(dims{1, k.N}, dt::f32, dims{k.N, 1});
  dnnl::primitive_attr attr;
  // The plans are shared by every calling thread. oneDNN's default, library-managed scratchpad
  // is one buffer for all primitives, which only allows executing a primitive in the thread that
  // created it (oneDNN's scratchpad_mode docs); two trainings in two threads crashed inside the
  // JIT code that way. With a user scratchpad each caller passes its own (scratchpad() below),
  // and one primitive may run in several threads at once.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (k.accumulate) {
    // dst = product + bias + 1.0 * dst_old: the sum post-op is oneDNN's beta = 1.
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  auto desc = k.has_bias ? dnnl::matmul::desc(plan->a_md, plan->b_md, plan->bias_md, plan->c_md)
                         : dnnl::matmul::desc(plan->a_md, plan->b_md, plan->c_md);
  dnnl::matmul::primitive_desc pd(desc, attr, cpu_engine());
  plan->scratch_md = pd.scratchpad_desc();
  plan->primitive = dnnl::matmul(pd);
  return plan;
}

// The same product in plain loops (f32 accumulation, k innermost): used only when oneDNN
// rejects a configuration, so that callers never see an exception from a kernel.
std::atomic<bool> force_fallback{false};

// C[i] = value (+ old C[i]), in f32, rounded once to nearest even when C is bf16.
void store(const GemmArgs& g, int64_t i, float value) {
  if (g.C_bf16 != nullptr) {
    g.C_bf16[i] = float_to_bf16(g.accumulate ? bf16_to_float(g.C_bf16[i]) + value : value);
    return;
  }
  g.C[i] = g.accumulate ? g.C[i] + value : value;
}

void gemm_fallback(const GemmArgs& g) {
  auto load = [&g](const void* p, int64_t i) -> float {
    if (g.type == GemmType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    return static_cast<const float*>(p)[i];
  };
  for (int64_t m = 0; m < g.M; ++m) {
    for (int64_t n = 0; n < g.N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < g.K; ++k) {
        float a = load(g.A, g.trans_a ? k * g.lda + m : m * g.lda + k);
        float b = load(g.B, g.trans_b ? n * g.ldb + k : k * g.ldb + n);
        acc += a * b;
      }
      if (g.bias) acc += g.bias[n];
      store(g, m * g.ldc + n, acc);
    }
  }
}

// Products of a few rows too small to pay the matmul primitive's cost per call: a decoder step at
// batch 1 multiplies one row (four with beam search) by a 64 x 64 weight, about 0.1 us of
// arithmetic, and executing the primitive (argument checks, memory objects, its scratchpad) took
// 1-2 us around it: a fifth of `attn translate --batch-size 1`. oneDNN's BLAS-like sgemm computes
// them without that bookkeeping: 0.84 -> 0.63 s (greedy) and 1.17 -> 1.01 s (beam 4) for 4,096
// dates at batch 1 on one thread; from 2^17 multiply-adds (32 rows) it ran slower than the
// primitive. At most kSmallGemmRows rows: the primitive gives a row the same bits however many
// rows come with it (a batch cut into shards computes what the whole batch does,
// tests/test_nn_dropout_global_index.cpp), and sgemm's bits differ from the primitive's, so only
// products of so few rows that no training batch cuts into them take it. The linear layer's
// forward only: f32, op(B) = B^T, no bf16 output.
constexpr int64_t kSmallGemmRows = 4, kSmallGemmMacs = int64_t{1} << 15;

bool small_gemm(const GemmArgs& g) {
  return g.M <= kSmallGemmRows && g.type == GemmType::kF32 && g.trans_b && !g.trans_a &&
         g.C != nullptr && g.C_bf16 == nullptr && !(g.accumulate && g.bias) &&
         g.M * g.N * g.K <= kSmallGemmMacs;
}

void small_gemm_f32(const GemmArgs& g) {
  // C = bias (or C), then C += A B^T through oneDNN's BLAS-like sgemm (row-major; no primitive,
  // no memory objects), on the calling thread.
  if (!g.accumulate) {
    for (int64_t m = 0; m < g.M; ++m) {
      float* c = g.C + m * g.ldc;
      if (g.bias)
        std::copy(g.bias, g.bias + g.N, c);
      else
        std::fill(c, c + g.N, 0.0f);
    }
  }
  const bool has_c = g.accumulate || g.bias;
  if (dnnl_sgemm('N', 'T', g.M, g.N, g.K, 1.0f, static_cast<const float*>(g.A), g.lda,
                 static_cast<const float*>(g.B), g.ldb, has_c ? 1.0f : 0.0f, g.C,
                 g.ldc) != dnnl_success)
    gemm_fallback(g);
}

// The threads a product is worth (kernels/cpu/parallel.hpp): 2 M N K flops, counted up to twice
// over when a dimension is under 32, since oneDNN's blocks are wider and such a product runs at a
// fraction of the peak: the tagging head's (3,000 x 128) x (128 x 8) took 78 us on one Zen 5 core
// (105 GFLOP/s; 245 for the model's wide products), and its 6 MFLOP had kept it on one thread
// while the other waited.
int gemm_threads(const GemmArgs& g, int threads) {
  const int64_t smallest = std::min({g.M, g.N, g.K});
  const double narrow = smallest < 32 ? 1.0 + 8.0 / static_cast<double>(smallest) : 1.0;
  return threads_for(
      2.0 * static_cast<double>(g.M) * static_cast<double>(g.N) * static_cast<double>(g.K) * narrow,
      std::max(1, threads));
}

// Restores the calling thread's OpenMP thread count when the call ends (also on exceptions).
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads) : previous_(omp_get_max_threads()) {
    if (threads != previous_) omp_set_num_threads(threads);
  }
  ~ScopedOmpThreads() {
    if (omp_get_max_threads() != previous_) omp_set_num_threads(previous_);
  }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int previous_;
};

// A plan with this thread's memory objects and argument map, bound to new buffers per call.
// Kept per thread (oneDNN does not document memory objects as safe to share), found without the
// shared map's lock after the first call; gemm_cache_clear() empties every thread's map too (by
// an epoch each thread checks).
struct ThreadPlan {
  std::shared_ptr<GemmPlan> plan;
  dnnl::memory a, b, c, bias, scratch;
  std::unordered_map<int, dnnl::memory> args;
};

std::atomic<uint64_t> cache_epoch{0};

// Null when oneDNN rejects the configuration (remembered: creating a primitive that fails costs
// as much as one that succeeds, and the caller's fallback runs on every call).
ThreadPlan* thread_plan(const GemmKey& key) {
  thread_local std::unordered_map<GemmKey, ThreadPlan, GemmKeyHash> plans;
  thread_local uint64_t epoch = 0;
  if (const uint64_t now = cache_epoch.load(std::memory_order_acquire); now != epoch) {
    plans.clear();
    epoch = now;
  }
  if (auto it = plans.find(key); it != plans.end()) return it->second.plan ? &it->second : nullptr;
  std::shared_ptr<GemmPlan> plan;
  bool known = false;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (auto it = cache.find(key); it != cache.end()) plan = it->second, known = true;
  }
  if (!known) {
    // Created outside the lock (creating a primitive is slow next to a lookup); a concurrent
    // duplicate is harmless. A rejected configuration is cached as a null plan.
    try {
      plan = make_plan(key);
    } catch (const dnnl::error&) {
      plan = nullptr;
    }
    std::lock_guard<std::mutex> lock(cache_mutex);
    cache.emplace(key, plan);
  }
  if (!plan) {
    plans.emplace(key, ThreadPlan{});
    return nullptr;
  }
  auto& eng = cpu_engine();
  ThreadPlan tp;
  tp.a = dnnl::memory(plan->a_md, eng, DNNL_MEMORY_NONE);
  tp.b = dnnl::memory(plan->b_md, eng, DNNL_MEMORY_NONE);
  tp.c = dnnl::memory(plan->c_md, eng, DNNL_MEMORY_NONE);
  tp.args = {{DNNL_ARG_SRC, tp.a}, {DNNL_ARG_WEIGHTS, tp.b}, {DNNL_ARG_DST, tp.c}};
  if (plan->scratch_md.get_size() > 0) {
    tp.scratch = dnnl::memory(plan->scratch_md, eng, DNNL_MEMORY_NONE);
    tp.args.emplace(DNNL_ARG_SCRATCHPAD, tp.scratch);
  }
  if (key.has_bias) {
    tp.bias = dnnl::memory(plan->bias_md, eng, DNNL_MEMORY_NONE);
    tp.args.emplace(DNNL_ARG_BIAS, tp.bias);
  }
  tp.plan = std::move(plan);
  return &plans.emplace(key, std::move(tp)).first->second;
}

// How gemm() shares a product between threads: `parts` slices of the output's rows (M), each one
// single-thread primitive, all in one parallel region of the caller's. oneDNN's own partition of
// a primitive built for several threads left one thread waiting at the region's end: 2-thread runs
// on Zen 5 of the linear forward (x W^T, 3040 x 128 x 128 and 3584 x 256 x 128) took 268-276 and
// 486-586 us where two half-row slices took 204-208 and 470-480 us, and the training loop's
// threads idled 2% of the wall at oneDNN's end barriers (bench/omp_trace.py). A slice boundary is
// a multiple of 16 rows and each slice keeps at least kMinSlice rows; fewer rows, and the weight
// gradient's product (trans_a), stay with oneDNN's threads. Only slices of rows keep the bits: a
// row of a plain or trans_b product comes out the same from a slice as from the whole product on
// one thread (tests/test_kernels_matmul_cpu.cpp, SlicedProductsAreTheSingleThreadBits), while a
// single-thread primitive's bits depend on M for trans_a (512 x 512 x 2048: half the rows gave
// other bits) and on N when columns were cut (8 x 130 x 700).
constexpr int64_t kMinSlice = 32, kSliceAlign = 16;
// Parts of a gemm_then task per thread of a cut product: enough that a thread which finishes its
// slice early can take a slower one's last parts, few enough that each is worth a claim.
constexpr int kTaskPartsPerThread = 4;
// The last rows of a cut product: kTailPieces pieces of kTailRows rows per thread, after the
// slices, each thread's own first, then a slower one's (TaskShares). Only where a slice keeps at
// least kTailMinHead rows per tail row of its thread.
constexpr int64_t kTailRows = 64, kTailPieces = 2, kTailMinHead = 4;

struct Cut {
  int64_t head = 0;  // rows [0, head) in slices; [head, M) in tail pieces
  int64_t pieces = 0;
  int64_t rows = kTailRows;  // per tail piece
  int64_t piece_start(int64_t k, int64_t M) const { return k >= pieces ? M : head + k * rows; }
};

Cut gemm_cut(int64_t M, int slices) {
  const int64_t tail = slices * kTailPieces * kTailRows;
  Cut c;
  if (M - tail < tail * kTailMinHead) {
    c.head = M;
    return c;
  }
  c.head = (M - tail) / kSliceAlign * kSliceAlign;
  c.pieces = slices * kTailPieces;  // the last one also takes the rows under kSliceAlign
  return c;
}

// attn's row-exact kernel (gemm_rows.hpp) gives a row the same bits in any piece, so its products
// are all pieces: kRowsPiecesPerThread per thread, multiples of its 6-row tiles, each thread's
// own first (its static share), then a slower one's (TaskShares). The weight gradients' few
// hundred rows too, which oneDNN's slices left to 2 static halves.
constexpr int64_t kRowsPiecesPerThread = 32, kRowsTile = 6;

Cut rows_cut(int64_t M, int slices) {
  Cut c;
  const int64_t want = (M + slices * kRowsPiecesPerThread - 1) / (slices * kRowsPiecesPerThread);
  c.rows = std::max<int64_t>(kRowsTile, (want + kRowsTile - 1) / kRowsTile * kRowsTile);
  c.pieces = (M + c.rows - 1) / c.rows;
  return c;
}

// The f32 kernel at start: kAuto, or the A/B switch ATTN_GEMM_F32=onednn|rows (benchmarks on one
// machine; tests set it through gemm_set_f32_kernel).
GemmF32Kernel f32_kernel_from_env() {
  const char* v = std::getenv("ATTN_GEMM_F32");
  if (v != nullptr && std::strcmp(v, "onednn") == 0) return GemmF32Kernel::kOneDnn;
  if (v != nullptr && std::strcmp(v, "rows") == 0) return GemmF32Kernel::kRows;
  return GemmF32Kernel::kAuto;
}
std::atomic<GemmF32Kernel> f32_kernel{f32_kernel_from_env()};

// How a product with trans_a on oneDNN (a weight gradient: the contraction over the batch's rows)
// runs on several threads. kChunksOfK (the default): single-thread primitives on chunks of
// about kWgradChunk rows of the contraction, each into its own float partial, summed in
// chunk order, so the bits depend on the shape alone, for any thread count up to the number of
// chunks (more threads than chunks take oneDNN's). oneDNN's own threads (kOneDnn) split K by the
// thread count, and on an AMX Xeon spent more time in a serial part than in the parallel one
// (session 24: 8% of a bf16 step's wall at 2 threads, the other thread idle).
// A/B switch: ATTN_GEMM_WGRAD=onednn; tests: gemm_set_wgrad_cut.
WgradCut wgrad_cut_from_env() {
  const char* v = std::getenv("ATTN_GEMM_WGRAD");
  return v != nullptr && std::strcmp(v, "onednn") == 0 ? WgradCut::kOneDnn : WgradCut::kChunksOfK;
}
std::atomic<WgradCut> wgrad_cut{wgrad_cut_from_env()};
constexpr int64_t kWgradChunk = 512;
constexpr int64_t kWgradMaxChunks = 32;
constexpr int64_t kWgradPartialBytes = int64_t{32} << 20;

// The chunks of a weight gradient's contraction: ceil(K / kWgradChunk) of them (at most
// kWgradMaxChunks, their float partials within kWgradPartialBytes), of equal rows but the last;
// count 0: not cut (K of one chunk, or an output too large to hold twice). The shape alone decides.
struct WgradChunks {
  int64_t count = 0, rows = 0;
};
WgradChunks wgrad_chunks(const GemmArgs& g) {
  if (g.K <= kWgradChunk) return {};
  int64_t count = std::min((g.K + kWgradChunk - 1) / kWgradChunk, kWgradMaxChunks);
  count = std::min(count, kWgradPartialBytes / std::max<int64_t>(1, g.M * g.N * 4));
  if (count < 2) return {};
  return {count, (g.K + count - 1) / count};
}
std::atomic<bool> force_widened{false}, force_widened_whole{false};  // test switches

bool widened_bf16();  // below

// Whether this float32 product runs on gemm_rows_f32 (gemm_rows.hpp: CPUs where oneDNN's kernel
// would make a row's bits depend on M), whose rows are exact in any slice, trans_a included.
bool rows_kernel(const GemmArgs& g) {
  if (g.type == GemmType::kBF16)
    return widened_bf16() && gemm_rows_supported() &&
           !force_widened_whole.load(std::memory_order_relaxed);
  switch (f32_kernel.load(std::memory_order_relaxed)) {
    case GemmF32Kernel::kOneDnn:
      return false;
    case GemmF32Kernel::kRows:
      return gemm_rows_supported();
    case GemmF32Kernel::kAuto:
      break;
  }
  return gemm_rows_preferred();
}

// gemm_rows_f32 on `threads` threads, each a share of the columns (runs of 16-column panels).
constexpr int64_t kRowsPanel = 16;
void gemm_rows_columns(const GemmArgs& g, int threads) {
  const int64_t panels = (g.N + kRowsPanel - 1) / kRowsPanel;
  const int64_t per_task = std::max<int64_t>(1, panels / (int64_t{threads} * 4));
  const int64_t tasks = (panels + per_task - 1) / per_task;
  const size_t in_bytes = g.type == GemmType::kBF16 ? sizeof(uint16_t) : sizeof(float);
  const float* kept = gemm_rows_fixed_packing(g);  // a weight packed at an earlier call, or null
  parallel_for(tasks, threads, [&](int64_t t) {
    const int64_t n0 = t * per_task * kRowsPanel, n1 = std::min(g.N, n0 + per_task * kRowsPanel);
    GemmArgs c = g;
    c.N = n1 - n0;
    c.B = static_cast<const std::byte*>(g.B) +
          static_cast<size_t>(g.trans_b ? n0 * g.ldb : n0) * in_bytes;
    if (g.C != nullptr) c.C = g.C + n0;
    if (g.C_bf16 != nullptr) c.C_bf16 = g.C_bf16 + n0;
    if (g.bias != nullptr) c.bias = g.bias + n0;
    gemm_rows_f32(c, kept != nullptr ? kept + n0 * g.K : nullptr);  // its panels, if kept
  });
}

// The calling thread's buffer for op(B) packed once for every slice of a product (gemm_rows.hpp),
// grown to the largest, 64-byte aligned.
float* shared_packing(int64_t floats) {
  thread_local std::vector<float> buffer;
  return grown_aligned(buffer, static_cast<size_t>(floats));
}

// The slices gemm() cuts a product into on `threads` threads; 1: none.
int gemm_slices(const GemmArgs& g, int threads) {
  if (threads <= 1 || (g.trans_a && !rows_kernel(g)) || omp_in_parallel()) return 1;
  return g.M >= threads * kMinSlice ? threads : 1;
}

// Start of slice `part` of `parts` over `extent`: rounded down to kSliceAlign, the last at extent.
int64_t slice_start(int64_t extent, int part, int parts) {
  if (part >= parts) return extent;
  return extent * part / parts / kSliceAlign * kSliceAlign;
}

// Rows [begin, end) of the output as a product of their own.
GemmArgs gemm_rows(const GemmArgs& g, int64_t begin, int64_t end) {
  const size_t in_bytes = g.type == GemmType::kBF16 ? sizeof(uint16_t) : sizeof(float);
  GemmArgs s = g;
  s.M = end - begin;
  // Row m of op(A): row m of A, or column m of A's storage (trans_a).
  const int64_t a_row_step = g.trans_a ? 1 : g.lda;
  s.A = static_cast<const std::byte*>(g.A) + static_cast<size_t>(begin * a_row_step) * in_bytes;
  if (g.C != nullptr) s.C = g.C + begin * g.ldc;
  if (g.C_bf16 != nullptr) s.C_bf16 = g.C_bf16 + begin * g.ldc;
  return s;
}

void gemm_one(const GemmArgs& g, const GemmKey& key);                              // below
void gemm_widened(const GemmArgs& g, int threads, RegionTask task, RowTask rows);  // below
void gemm_wgrad_chunks(const GemmArgs& g, WgradChunks chunks, int threads);        // below

// Whether oneDNN multiplies bf16 matrices on this CPU (AVX-512 and up; probed once with a small
// plan). Below AVX-512 (Zen 2 and 3, Intel's client cores before AVX10) oneDNN 2.6 rejects every
// bf16 matmul.
bool onednn_bf16() {
  static const bool native = [] {
    try {
      (void)make_plan(GemmKey{16, 16, 16, 16, 16, 16, 1, static_cast<uint8_t>(GemmType::kBF16),
                              false, true, false, false, false});
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return native;
}

// Whether bf16 products are float products of the widened inputs here (no oneDNN bf16 matmul, or
// the test switch): on attn's row-exact kernel where the CPU has AVX2 (the widening inside its
// pieces), else gemm_widened().
bool widened_bf16() {
  return force_widened.load(std::memory_order_relaxed) || !onednn_bf16();
}

}  // namespace

bool gemm_bf16_native() {
  return onednn_bf16();
}

void gemm(const GemmArgs& g, int threads) {
  gemm_then(g, threads, {});
}

void gemm_then(const GemmArgs& g, int threads, RegionTask task, RowTask rows) {
  const auto run_task_after = [&] {
    if (rows.run != nullptr && g.M > 0) rows.run(rows.data, 0, g.M);
    if (task.run != nullptr) task.run(task.data, 0, 1);
  };
  if (g.M <= 0 || g.N <= 0) return run_task_after();
  if (g.K <= 0) {
    // Empty contraction: the product is zero, only bias and the old C remain.
    for (int64_t m = 0; m < g.M; ++m)
      for (int64_t n = 0; n < g.N; ++n)
        store(g, m * g.ldc + n, g.bias ? g.bias[n] : 0.f);
    return run_task_after();
  }
  if (force_fallback.load(std::memory_order_relaxed)) {
    gemm_fallback(g);
    return run_task_after();
  }
  if (g.type == GemmType::kBF16 && widened_bf16() &&
      (!gemm_rows_supported() || force_widened_whole.load(std::memory_order_relaxed)))
    return gemm_widened(g, threads, task, rows);
  threads = gemm_threads(g, threads);
  if (const int slices = gemm_slices(g, threads); slices > 1) {
    // The task in kTaskPartsPerThread parts per thread, each thread's own first, then stolen
    // (TaskShares): a thread done with its slice early takes parts of a slower one's.
    const int task_parts = task.run != nullptr ? slices * kTaskPartsPerThread : 0;
    TaskShares shares(task_parts, slices);
    // attn's row-exact kernel: op(B) packed once for every piece, its panels by the threads
    // (or kept from an earlier call: a weight in a GemmFixedPackingScope).
    const bool rows_f32 = rows_kernel(g);
    const float* kept = rows_f32 ? gemm_rows_fixed_packing(g) : nullptr;
    float* packed =
        rows_f32 && kept == nullptr ? shared_packing(gemm_rows_packed_size(g)) : nullptr;
    const float* panels_b = kept != nullptr ? kept : packed;
    const Cut cut = rows_f32 ? rows_cut(g.M, slices) : gemm_cut(g.M, slices);
    TaskShares tail(cut.pieces, slices);
    const int64_t panels = (g.N + 15) / 16;
    // No exception may leave the region: the first one is kept and rethrown after it.
    std::exception_ptr error;
#pragma omp parallel num_threads(slices)
    {
      const int part = omp_get_thread_num(), parts = slices;
      if (packed != nullptr) {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p)
          gemm_rows_pack_panels(g, packed, p, p + 1);
      }
      try {
        const int64_t begin = slice_start(cut.head, part, parts);
        const int64_t end = slice_start(cut.head, part + 1, parts);
        // Each piece's rows, then the row task on them while they are in this thread's cache.
        const auto piece = [&](int64_t r0, int64_t r1) {
          if (r1 <= r0) return;
          if (rows_f32)
            gemm_rows_f32(gemm_rows(g, r0, r1), panels_b);
          else
            gemm(gemm_rows(g, r0, r1), 1);
          if (rows.run != nullptr) rows.run(rows.data, r0, r1);
        };
        piece(begin, end);
        tail.run(part,
                 [&](int64_t k) { piece(cut.piece_start(k, g.M), cut.piece_start(k + 1, g.M)); });
        shares.run(part, [&](int64_t p) { task.run(task.data, static_cast<int>(p), task_parts); });
      } catch (...) {
#pragma omp critical(attn_gemm_slice_error)
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
  if (threads > 1 && g.N > kRowsPanel && rows_kernel(g) && !omp_in_parallel()) {
    // Too few rows to cut (a weight gradient of a few output features): columns instead, in
    // panels of 16, which give an element the same bits too.
    gemm_rows_columns(g, threads);
    return run_task_after();
  }
  if (g.trans_a && !rows_kernel(g) && !omp_in_parallel() &&
      wgrad_cut.load(std::memory_order_relaxed) == WgradCut::kChunksOfK) {
    // No more threads than chunks: on 16 threads 8 chunks left half of them idle (-10% on an
    // AMX Xeon's training step, where oneDNN's threads cut M and N too).
    if (const WgradChunks chunks = wgrad_chunks(g); chunks.count >= std::max(threads, 2)) {
      gemm_wgrad_chunks(g, chunks, threads);
      return run_task_after();
    }
  }
  const GemmKey key{g.M,
                    g.N,
                    g.K,
                    g.lda,
                    g.ldb,
                    g.ldc,
                    threads,
                    static_cast<uint8_t>(g.type),
                    g.trans_a,
                    g.trans_b,
                    g.bias != nullptr,
                    g.accumulate,
                    g.C_bf16 != nullptr};
  {
    ScopedOmpThreads omp_threads(threads);
    gemm_one(g, key);
  }
  run_task_after();
}

namespace {

// One product on oneDNN's threads (as many as the key says), or the small-product path.
void gemm_one(const GemmArgs& g, const GemmKey& key) {
  if (rows_kernel(g)) return gemm_rows_f32(g, gemm_rows_fixed_packing(g));
  if (small_gemm(g)) return small_gemm_f32(g);
  try {
    ThreadPlan* tp = thread_plan(key);
    if (tp == nullptr) {
      // Rejected: a bf16 product through float (gemm_widened), anything else the plain loop.
      if (g.type == GemmType::kBF16) return gemm_widened(g, 1, {}, {});
      return gemm_fallback(g);
    }
    // Rebind the plan's memory objects to this call's buffers: no memory objects and no argument
    // map are built per call (their allocations were a tenth of a small decode step).
    tp->a.set_data_handle(const_cast<void*>(g.A));  // oneDNN only reads src and weights
    tp->b.set_data_handle(const_cast<void*>(g.B));
    tp->c.set_data_handle(g.C_bf16 != nullptr ? static_cast<void*>(g.C_bf16) : g.C);
    if (const size_t bytes = tp->plan->scratch_md.get_size(); bytes > 0)
      tp->scratch.set_data_handle(scratchpad(bytes));
    if (g.bias) tp->bias.set_data_handle(const_cast<float*>(g.bias));
    auto& stream = thread_stream();
    tp->plan->primitive.execute(stream, tp->args);
    stream.wait();
  } catch (const dnnl::error&) {
    gemm_fallback(g);
  }
}

// WgradCut::kChunksOfK: op(A) is A's storage transposed, so the contraction's rows [k0, k1) are
// rows k0.. of A's storage and of B (or columns of B's storage, trans_b). Each chunk's product
// goes to its own float (M, N) partial on one thread; then each output row is the partials' sum
// in chunk order, plus the bias, plus the old C (accumulate), rounded once for a bf16 output.
// On one thread the chunks run in turn, so that 1 and 2 threads give the same bits.
void gemm_wgrad_chunks(const GemmArgs& g, WgradChunks cut, int threads) {
  const size_t in_bytes = g.type == GemmType::kBF16 ? sizeof(uint16_t) : sizeof(float);
  const int64_t chunks = cut.count, mn = g.M * g.N;
  thread_local std::vector<float> buffer;
  float* partials = grown_aligned(buffer, static_cast<size_t>(chunks * mn));
  // No exception may leave the region (a plan's allocation): the first one is kept and rethrown.
  std::exception_ptr error;
  parallel_for(chunks, threads, [&](int64_t c) {
    const int64_t k0 = c * cut.rows, k1 = std::min(g.K, k0 + cut.rows);
    if (k1 <= k0) {  // (cannot happen for count <= ceil(K / 512); kept exact regardless)
      std::fill_n(partials + c * mn, mn, 0.0f);
      return;
    }
    GemmArgs p = g;
    p.K = k1 - k0;
    p.A = static_cast<const std::byte*>(g.A) + static_cast<size_t>(k0 * g.lda) * in_bytes;
    p.B = static_cast<const std::byte*>(g.B) +
          static_cast<size_t>(g.trans_b ? k0 : k0 * g.ldb) * in_bytes;
    p.C = partials + c * mn, p.ldc = g.N, p.C_bf16 = nullptr;
    p.bias = nullptr, p.accumulate = false;
    try {
      gemm(p, 1);
    } catch (...) {
#pragma omp critical(attn_gemm_chunk_error)
      if (!error) error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
  constexpr int64_t kRowsPerTask = 8;
  parallel_for((g.M + kRowsPerTask - 1) / kRowsPerTask, threads, [&](int64_t t) {
    const int64_t m0 = t * kRowsPerTask, m1 = std::min(g.M, m0 + kRowsPerTask);
    for (int64_t m = m0; m < m1; ++m) {
      float* sum = partials + m * g.N;  // the first chunk's row, summed in place
      for (int64_t c = 1; c < chunks; ++c) {
        const float* part = partials + c * mn + m * g.N;
        for (int64_t n = 0; n < g.N; ++n)
          sum[n] += part[n];
      }
      if (g.bias != nullptr)
        for (int64_t n = 0; n < g.N; ++n)
          sum[n] += g.bias[n];
      if (g.C_bf16 != nullptr) {
        round_rows_to_bf16(sum, g.N, g.C_bf16 + m * g.ldc, g.ldc, 1, g.N, g.accumulate);
      } else {
        float* out = g.C + m * g.ldc;
        for (int64_t n = 0; n < g.N; ++n)
          out[n] = g.accumulate ? sum[n] + out[n] : sum[n];
      }
    }
  });
}

// A bf16 output's rows [r0, r1) from the float product c32 (M, N): each value (plus the old
// output, with accumulate, added in float) rounded once to nearest even; then the caller's row
// task on them.
struct RoundRows {
  const GemmArgs* g;
  const float* c32;
  RowTask then;
  static void run(void* data, int64_t r0, int64_t r1) {
    const auto& t = *static_cast<const RoundRows*>(data);
    const GemmArgs& g = *t.g;
    round_rows_to_bf16(t.c32 + r0 * g.N, g.N, g.C_bf16 + r0 * g.ldc, g.ldc, r1 - r0, g.N,
                       g.accumulate);
    if (t.then.run != nullptr) t.then.run(t.then.data, r0, r1);
  }
};

// A bf16 product where oneDNN has no bf16 matmul (onednn_bf16() false). A and B are widened to
// float, which is exact, and the float product runs as any other (the same cut, threads, row and
// region tasks); a bf16 output is rounded as its rows are done, by the thread that computed them.
// The native contract holds: each product of two bf16 values is exact in float, the sums are in
// float, one rounding at the end; only the order of the sums is the float kernel's (as it differs
// between oneDNN's bf16 kernels too). The plain loop that computed these before ran on one
// thread: a bf16 training step was 20x slower than float32 on Zen 3 (257 against 5.3k tokens/s).
void gemm_widened(const GemmArgs& g, int threads, RegionTask task, RowTask rows) {
  // The stored matrices: A (M, K) or, trans_a, (K, M); B (K, N) or, trans_b, (N, K).
  const int64_t a_rows = g.trans_a ? g.K : g.M, a_cols = g.trans_a ? g.M : g.K;
  const int64_t b_rows = g.trans_b ? g.N : g.K, b_cols = g.trans_b ? g.K : g.N;
  const int64_t a_size = a_rows * a_cols, b_size = b_rows * b_cols;
  const int64_t c_size = g.C_bf16 != nullptr ? g.M * g.N : 0;
  // The calling thread's buffer, grown to the largest product it has widened (the region's other
  // threads only read it, and gemm_then below does not come back here: its product is float).
  thread_local std::vector<float> buffer;
  const auto need = static_cast<size_t>(a_size + b_size + c_size);
  if (buffer.size() < need) buffer.resize(need);
  float* a32 = buffer.data();
  float* b32 = a32 + a_size;
  float* c32 = b32 + b_size;
  // Both widenings in one region, in tasks of about 16K elements (whole rows).
  const auto* a16 = static_cast<const uint16_t*>(g.A);
  const auto* b16 = static_cast<const uint16_t*>(g.B);
  constexpr int64_t kTaskElements = int64_t{1} << 14;
  const int64_t a_step = std::max<int64_t>(1, kTaskElements / std::max<int64_t>(1, a_cols));
  const int64_t b_step = std::max<int64_t>(1, kTaskElements / std::max<int64_t>(1, b_cols));
  const int64_t a_tasks = (a_rows + a_step - 1) / a_step, b_tasks = (b_rows + b_step - 1) / b_step;
  const int team = omp_in_parallel() || a_size + b_size < 2 * kTaskElements ? 1 : threads;
  parallel_for(a_tasks + b_tasks, team, [&](int64_t t) {
    const bool is_a = t < a_tasks;
    const int64_t step = is_a ? a_step : b_step, rows_total = is_a ? a_rows : b_rows;
    const int64_t cols = is_a ? a_cols : b_cols, ld = is_a ? g.lda : g.ldb;
    const uint16_t* src = is_a ? a16 : b16;
    float* dst = is_a ? a32 : b32;
    const int64_t r0 = (is_a ? t : t - a_tasks) * step, r1 = std::min(rows_total, r0 + step);
    for (int64_t r = r0; r < r1; ++r)
      bf16_to_floats(src + r * ld, dst + r * cols, cols);
  });
  GemmArgs f = g;
  f.type = GemmType::kF32;
  f.A = a32, f.lda = a_cols;
  f.B = b32, f.ldb = b_cols;
  f.b_fixed = false;  // a copy of this call's
  RoundRows round{&g, c32, rows};
  if (g.C_bf16 != nullptr) {
    f.C_bf16 = nullptr;
    f.C = c32, f.ldc = g.N, f.accumulate = false;  // the old value is added as the rows round
    rows = RowTask{&RoundRows::run, &round};
  }
  gemm_then(f, threads, task, rows);
}

}  // namespace

void gemm_panels(const GemmArgs& g, int threads) {
  constexpr int64_t kTargetPanels = 16, kRowAlign = 16;
  const int64_t rows = std::max<int64_t>(
      kRowAlign, (g.M + kTargetPanels * kRowAlign - 1) / (kTargetPanels * kRowAlign) * kRowAlign);
  const int64_t panels = (g.M + rows - 1) / rows;
  if (panels <= 1 || g.N <= 0) return gemm(g, threads);
  threads = gemm_threads(g, threads);
  const size_t a_bytes = g.type == GemmType::kBF16 ? sizeof(uint16_t) : sizeof(float);
  // Row m of op(A): row m of A, or column m of A^T's storage.
  const int64_t a_row_step = g.trans_a ? 1 : g.lda;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < panels; ++i) {
    GemmArgs p = g;
    const int64_t m0 = i * rows;
    p.M = std::min(rows, g.M - m0);
    p.A = static_cast<const std::byte*>(g.A) + static_cast<size_t>(m0 * a_row_step) * a_bytes;
    if (g.C_bf16 != nullptr) p.C_bf16 = g.C_bf16 + m0 * g.ldc;
    if (g.C != nullptr) p.C = g.C + m0 * g.ldc;
    gemm(p, 1);
  }
}

namespace {

// The column sums are compiled per target (ATTN_MATMUL_CLONES above; the baseline x86-64 build
// adds two doubles per instruction, AVX-512 eight); adds only, in the same order in every clone,
// so the same bits.

// Columns per block: each block's sums are one thread's, in a stack array of doubles.
constexpr int64_t kColumnBlock = 32;

// acc[n] = sum over the M rows of dy[m * lddy + n], n < nb <= kColumnBlock, row by row.
template <typename T>
inline void column_block(const T* dy, int64_t M, int64_t nb, int64_t lddy, double* acc) {
  for (int64_t n = 0; n < nb; ++n)
    acc[n] = 0.0;
  for (int64_t m = 0; m < M; ++m) {
    const T* row = dy + m * lddy;
#pragma omp simd
    for (int64_t n = 0; n < nb; ++n) {
      if constexpr (std::is_same_v<T, uint16_t>) {
        acc[n] += bf16_to_float(row[n]);
      } else {
        acc[n] += row[n];
      }
    }
  }
}

ATTN_MATMUL_CLONES void column_block_f32(const float* dy, int64_t M, int64_t nb, int64_t lddy,
                                         double* acc) {
  column_block(dy, M, nb, lddy, acc);
}

ATTN_MATMUL_CLONES void column_block_bf16(const uint16_t* dy, int64_t M, int64_t nb, int64_t lddy,
                                          double* acc) {
  column_block(dy, M, nb, lddy, acc);
}

// Block j of kColumnBlock columns: its sums, rounded to float, into db (added with accumulate).
template <typename T>
void column_sum_block(const T* dy, int64_t M, int64_t N, int64_t lddy, float* db, bool accumulate,
                      int64_t j) {
  const int64_t n0 = j * kColumnBlock, nb = std::min(kColumnBlock, N - n0);
  double acc[kColumnBlock];
  if constexpr (std::is_same_v<T, uint16_t>) {
    column_block_bf16(dy + n0, M, nb, lddy, acc);
  } else {
    column_block_f32(dy + n0, M, nb, lddy, acc);
  }
  // With accumulate the sum is rounded to float, then added: as computing db and adding it.
  for (int64_t n = 0; n < nb; ++n)
    db[n0 + n] = accumulate ? db[n0 + n] + static_cast<float>(acc[n]) : static_cast<float>(acc[n]);
}

template <typename T>
void column_sum_impl(const T* dy, int64_t M, int64_t N, int64_t lddy, float* db, bool accumulate,
                     int threads) {
  // Row by row so the inner loop is unit-stride over n (vectorizes), into double accumulators:
  // the bias gradient is often a sum of many terms that cancel (exactly 0 for the key bias of
  // attention), where an f32 running sum would keep only its rounding noise. Each column's sum
  // runs over the rows in order, whichever thread takes its block of columns, so the result is
  // independent of the thread count.
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) num_threads( \
    std::max(1, threads)) if (threads > 1 && blocks > 1 && M * N >= (int64_t{1} << 15))
  for (int64_t j = 0; j < blocks; ++j)
    column_sum_block(dy, M, N, lddy, db, accumulate, j);
}

// Blocks [blocks * part / parts, blocks * (part + 1) / parts).
template <typename T>
void column_sum_part_impl(const T* dy, int64_t M, int64_t N, int64_t lddy, float* db,
                          bool accumulate, int part, int parts) {
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
  for (int64_t j = blocks * part / parts; j < blocks * (part + 1) / parts; ++j)
    column_sum_block(dy, M, N, lddy, db, accumulate, j);
}

}  // namespace

void column_sum(const float* dy, int64_t M, int64_t N, int64_t lddy, float* db, bool accumulate,
                int threads) {
  column_sum_impl(dy, M, N, lddy, db, accumulate, threads);
}

void column_sum(const uint16_t* dy, int64_t M, int64_t N, int64_t lddy, float* db, bool accumulate,
                int threads) {
  column_sum_impl(dy, M, N, lddy, db, accumulate, threads);
}

void column_sum_part(const float* dy, int64_t M, int64_t N, int64_t lddy, float* db,
                     bool accumulate, int part, int parts) {
  column_sum_part_impl(dy, M, N, lddy, db, accumulate, part, parts);
}

void column_sum_part(const uint16_t* dy, int64_t M, int64_t N, int64_t lddy, float* db,
                     bool accumulate, int part, int parts) {
  column_sum_part_impl(dy, M, N, lddy, db, accumulate, part, parts);
}

void gemm_force_fallback(bool on) {
  force_fallback.store(on, std::memory_order_relaxed);
}

void gemm_set_f32_kernel(GemmF32Kernel kernel) {
  f32_kernel.store(kernel, std::memory_order_relaxed);
}

void gemm_set_wgrad_cut(WgradCut cut) {
  wgrad_cut.store(cut, std::memory_order_relaxed);
}

void gemm_force_widened_bf16(bool on) {
  force_widened.store(on, std::memory_order_relaxed);
}

void gemm_force_widened_whole_bf16(bool on) {
  force_widened_whole.store(on, std::memory_order_relaxed);
}

size_t gemm_cache_size() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  return cache.size();
}

void gemm_cache_clear() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  cache.clear();
  cache_epoch.fetch_add(1, std::memory_order_release);
}

}  // namespace attn::cpu
