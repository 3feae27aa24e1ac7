// Ring attention (attn/ops/ring_attention.hpp): the sequence split over the ranks of a
// Communicator, key/value blocks rotated around the ring, the fused CPU kernels
// (ops/attention_kernel.hpp) run per block, partial results merged by log-sum-exp.
//
// Every mask attn supports keeps a prefix of the GLOBAL keys (ops/mask.hpp): row t keeps
// s < kept(t) with kept = min(valid length, t + 1 when causal). A key chunk that holds global
// keys [s0, s0 + n) therefore keeps the local prefix clamp(kept - s0, 0, n) of itself, so every
// (query rows, key chunk) pair is one kernel call with plain kept-key counts (causal lowered into
// them too), the kZero policy (a row without a kept key in this chunk adds nothing) and the
// chunk's own lse. Pairs whose key chunk lies entirely after the query chunk under causal are
// skipped. d2l's kUniform rows (no kept key at all) are fixed up at the end: the mean of all
// values forward, dv += dout / S on every key backward.
//
// Dropout draws the single-process kernel's mask on the gathered problem: weight (b, t, s) at
// stream index base + (b Tg + t) Sg + s, t and s GLOBAL positions, base =
// Context::dropout_index_base(lens_repeat Tg Sg). Each call places its block in the global
// problem through AttentionProblem::dropout_window (rows Tg, cols Sg, first query row and first
// key column of the pair), so every weight keeps its mask, whichever rank and step computes it;
// the merge by log-sum-exp is linear in the (dropped) block outputs. The kUniform fix-up draws
// the same mask on its 1/S weights. The forward takes one stream offset (as the single-process
// op does), the backward redraws with the offset stored in the result.
//
// Overlap: MPI moves a large non-blocking message only while the process is inside MPI (Open MPI
// has no progress thread by default), so each pair's queries are cut into pieces and the pending
// requests are tested between pieces.
#include "attn/ops/ring_attention.hpp"

#include "ops/attention_kernel.hpp"
#include "ops/common.hpp"
#include "ops/mask.hpp"

#include "attn/core/rng.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <exception>
#include <limits>
#include <type_traits>
#include <vector>

namespace attn {
namespace {

constexpr const char* kRing = "ring_attention";
constexpr const char* kRingBackward = "ring_attention_backward";
constexpr int kTagGrad = 7102;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rows [local, local + len) of a rank's shard hold global positions [global, global + len).
struct Segment {
  int64_t local, global, len;
};

std::vector<Segment> segments(RingLayout layout, int rank, int N, int64_t L) {
  if (layout == RingLayout::kContiguous) return {{0, rank * L, L}};
  const int64_t c = L / 2;
  return {{0, rank * c, c}, {c, (2 * static_cast<int64_t>(N) - 1 - rank) * c, c}};
}

struct RingDims {
  int64_t B = 0, T = 0, S = 0, D = 0, Dv = 0;  // local shapes
  int N = 1, rank = 0;
  RingLayout layout = RingLayout::kContiguous;
  int64_t S_global() const { return S * N; }
};

void check_tensor(const char* op, const char* name, const Tensor& t, const char* layout) {
  check(t.defined(), op, "{} is undefined, expected a float32 or bfloat16 {} tensor", name, layout);
  check(t.dtype() == DType::F32 || t.dtype() == DType::BF16, op,
        "{} {} has dtype {}, expected F32 or BF16", name, shape_arg(t.shape()),
        dtype_name(t.dtype()));
  detail::check_ndim(op, name, t, 3, layout);
}

// The local checks; throws Error naming op.
RingDims check_local(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& valid_lens, const RingOptions& opts) {
  check_tensor(op, "q", q, "(B, T_local, D)");
  check_tensor(op, "k", k, "(B, S_local, D)");
  check_tensor(op, "v", v, "(B, S_local, Dv)");
  detail::check_same_dtype(op, "k", k, "q", q);
  detail::check_same_dtype(op, "v", v, "q", q);
  RingDims d;
  d.B = q.dim(0), d.T = q.dim(1), d.S = k.dim(1), d.D = q.dim(2), d.Dv = v.dim(2);
  check(k.dim(0) == d.B && v.dim(0) == d.B, op,
        "batch sizes differ: q {}, k {}, v {}; expected the same B", shape_arg(q.shape()),
        shape_arg(k.shape()), shape_arg(v.shape()));
  check(k.dim(2) == d.D && d.D >= 1, op,
        "q {} and k {} differ in width (or it is 0), expected k (B, S_local, D) with D = {} >= 1",
        shape_arg(q.shape()), shape_arg(k.shape()), d.D);
  check(v.dim(1) == d.S, op,
        "k {} and v {} differ in length, expected v (B, S_local, Dv) with S_local = {}",
        shape_arg(k.shape()), shape_arg(v.shape()), d.S);
  detail::check_attention_options(op, opts.dropout, opts.scale);
  check(opts.lens_repeat >= 1, op, "lens_repeat is {}, expected >= 1", opts.lens_repeat);
  d.layout = opts.resolved_layout();
  if (d.layout == RingLayout::kZigzag)
    check(d.T % 2 == 0 && d.S % 2 == 0, op,
          "q {} and k {}: the zigzag layout needs even local lengths (the global length a "
          "multiple of 2N: two chunks per rank)",
          shape_arg(q.shape()), shape_arg(k.shape()));
  if (opts.causal)
    check(d.T == d.S, op,
          "causal ring attention needs q {} and k {} sharded alike (T_local == S_local)",
          shape_arg(q.shape()), shape_arg(k.shape()));
  check_valid_lens(op, valid_lens, d.B, d.T, opts.lens_repeat);
  return d;
}

// Local checks, then one collective comparison of shapes and options, so that a rank whose input
// is wrong, or differs from the others', makes every rank throw (no rank waits for a block that
// never comes). A local error is rethrown after the comparison.
RingDims check_ring(const char* op, const Context& ctx, Communicator& comm, const Tensor& q,
                    const Tensor& k, const Tensor& v, const Tensor& valid_lens,
                    const RingOptions& opts, const Tensor* dout = nullptr,
                    uint64_t dropout_offset = 0) {
  RingDims d;
  std::exception_ptr local;
  try {
    d = check_local(op, q, k, v, valid_lens, opts);
    if (dout) {
      check_tensor(op, "dout", *dout, "(B, T_local, Dv)");
      check(dout->shape() == Shape{d.B, d.T, d.Dv}, op,
            "dout has shape {}, expected (B, T_local, Dv) = {}", shape_arg(dout->shape()),
            shape_arg(Shape{d.B, d.T, d.Dv}));
      detail::check_same_dtype(op, "dout", *dout, "q", q);
    }
  } catch (...) {
    local = std::current_exception();
  }
  const int64_t lens_ndim = valid_lens.defined() ? valid_lens.ndim() : 0;
  // Dropout: every rank must draw from one stream (p, seed, the call's offset: the forward's
  // next one, or the one the backward redraws) and one data-parallel sample window.
  const bool drop = opts.training && opts.dropout > 0.0;
  const uint64_t offset = dout ? dropout_offset : ctx.dropout_offset();
  const std::vector<int64_t> values = {local ? 1 : 0,
                                       d.B,
                                       d.T,
                                       d.S,
                                       d.D,
                                       d.Dv,
                                       local ? -1 : static_cast<int64_t>(q.dtype()),
                                       opts.causal,
                                       static_cast<int64_t>(opts.masked_rows),
                                       static_cast<int64_t>(d.layout),
                                       opts.lens_repeat,
                                       lens_ndim,
                                       drop ? std::bit_cast<int64_t>(opts.dropout) : 0,
                                       drop ? static_cast<int64_t>(ctx.seed) : 0,
                                       drop ? static_cast<int64_t>(offset) : 0,
                                       drop ? static_cast<int64_t>(ctx.dropout_first_sample) : 0};
  const std::string what =
      "(input error, B, T_local, S_local, D, Dv, dtype, causal, masked_rows, layout, "
      "lens_repeat, valid_lens rank, dropout bits, seed, dropout offset, "
      "dropout_first_sample) = (" +
      fmt::format("{}", fmt::join(values, ", ")) + ")";
  if (local) {  // this rank's own error is the better message; the others learn that ranks differ
    try {
      comm.check_same(op, what, values);
    } catch (const Error&) {
    }
    std::rethrow_exception(local);
  }
  comm.check_same(op, what, values);
  d.N = comm.size();
  d.rank = comm.rank();
  check(d.S_global() < (int64_t{1} << 31), op, "{} keys in all, expected fewer than 2^31",
        d.S_global());
  return d;
}

// Kept global keys per local query row (B * T_local), or empty without valid_lens.
std::vector<int32_t> global_kept(const Tensor& valid_lens, const RingOptions& opts,
                                 const RingDims& d) {
  if (!valid_lens.defined()) return {};
  MaskOptions m;
  m.valid_lens = valid_lens;
  m.lens_repeat = opts.lens_repeat;
  return detail::kept_key_counts(m, d.B, d.T, d.S_global());
}

// Rows of the shard that keep no global key (only valid_lens can empty a row; causal keeps t).
std::vector<uint8_t> empty_rows(const std::vector<int32_t>& kept, const RingDims& d, bool* any) {
  std::vector<uint8_t> e(static_cast<size_t>(d.B * d.T), 0);
  *any = false;
  for (size_t i = 0; i < kept.size(); ++i)
    if (kept[i] == 0) e[i] = 1, *any = true;
  return e;
}

template <class E>
inline float to_f(E x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    return bf16_to_float(x);
  }
}
template <class E>
inline E from_f(float x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    return float_to_bf16(x);
  }
}

// A float32 accumulator for the zero-filled tensor t of element type E: t itself for float32,
// else `buf`, zero-filled to t's size (the caller rounds it into t at the end).
template <class E>
float* float_accumulator(Tensor& t, std::vector<float>& buf) {
  if constexpr (std::is_same_v<E, float>) {
    return t.data<float>();
  } else {
    buf.assign(static_cast<size_t>(t.numel()), 0.0f);
    return buf.data();
  }
}

// The dropout stream of one ring op, over the gathered problem (Tg, Sg): the single-process
// kernel's mask (kernels/attention_problem.hpp).
struct RingDropout {
  bool active = false;
  float p = 0.0f, keep_scale = 0.0f;
  uint64_t seed = 0, offset = 0, base = 0;
  int64_t Tg = 0, Sg = 0;

  RingDropout(const Context& ctx, const RingDims& d, const RingOptions& opts, uint64_t off) {
    active = opts.training && opts.dropout > 0.0;
    if (!active) return;
    p = static_cast<float>(opts.dropout);
    keep_scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;  // as the kernels compute it
    seed = ctx.seed, offset = off;
    Tg = d.T * d.N, Sg = d.S_global();
    // As detail::attention_dropout_index_base: a sample is lens_repeat rows of Tg x Sg weights.
    base = ctx.dropout_index_base(static_cast<uint64_t>(opts.lens_repeat * Tg * Sg));
  }
  // The multiplier of weight (b, tg, sg), global query tg and key sg: 0 or 1 / (1 - p).
  float z(int64_t b, int64_t tg, int64_t sg) const {
    return dropout_keep(seed, offset, base + static_cast<uint64_t>((b * Tg + tg) * Sg + sg), p)
               ? keep_scale
               : 0.0f;
  }
  // The kernel call of query rows [tg0, ..) against keys [sg0, ..) draws from the global mask.
  template <class E>
  void place(kernels::AttentionArgs<E>& a, int64_t tg0, int64_t sg0) const {
    a.dropout_window = {Tg, Sg, tg0, sg0};
  }
  template <class E>
  void set(kernels::AttentionArgs<E>& a) const {
    a.dropout = active ? p : 0.0f;
    a.seed = seed, a.offset = offset, a.dropout_index_base = base;
  }
};

// Global position of every local row of a shard (rank `rank`'s segments).
std::vector<int64_t> global_rows(RingLayout layout, int rank, int N, int64_t L) {
  std::vector<int64_t> g(static_cast<size_t>(L));
  for (const Segment& sg : segments(layout, rank, N, L))
    for (int64_t i = 0; i < sg.len; ++i)
      g[sg.local + i] = sg.global + i;
  return g;
}

// Pieces of query rows per kernel call, so the pending messages are progressed in between.
int64_t piece_rows(int64_t len) {
  return std::min(len, std::max<int64_t>(256, (len + 7) / 8));
}

// The kernel arguments shared by every call of one ring op, from the one builder
// (ops/attention_kernel.hpp): causal is lowered into each call's kept-key counts, a row without a
// kept key in a block adds nothing (kZero; d2l's kUniform rows are fixed up after the merge), and
// the dropout stream is RingDropout's (the gathered problem's), so the builder gets none. Each
// call then sets its block's T, S, kept keys, dropout window and views.
template <class E>
kernels::AttentionArgs<E> base_args(const Context& ctx, const RingDims& d,
                                    const RingOptions& opts) {
  AttentionOptions block;
  block.scale = opts.scale;
  block.mask.masked_rows = MaskedRowPolicy::kZero;
  kernels::AttentionArgs<E> p;
  static_cast<kernels::AttentionProblem&>(p) = detail::attention_problem(
      ctx, {d.B, 1, d.T, d.S, d.D, d.Dv}, /*kept=*/{}, block, /*dropout_offset=*/0);
  return p;
}

// One call's piece: query rows [t0, t0 + m) of query segment a against key segment ks.
// Fills `kept` (B * m) and returns false when no row keeps a key (nothing to compute).
bool piece_kept(const RingDims& d, const RingOptions& opts, const std::vector<int32_t>& gkept,
                const Segment& a, int64_t t0, int64_t m, const Segment& ks,
                std::vector<int32_t>& kept) {
  kept.resize(static_cast<size_t>(d.B * m));
  bool any = false;
  const int64_t Sg = d.S_global();
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < m; ++t) {
      const int64_t row = a.local + t0 + t;
      int64_t lim = gkept.empty() ? Sg : gkept[b * d.T + row];
      if (opts.causal) lim = std::min(lim, a.global + t0 + t + 1);
      const int64_t n = std::clamp<int64_t>(lim - ks.global, 0, ks.len);
      kept[b * m + t] = static_cast<int32_t>(n);
      any |= n > 0;
    }
  return any;
}

// The pending requests of a step, tested between kernel calls.
// The pending requests of a step, tested between kernel calls.
struct Pending {
  std::vector<Request*> reqs;
  void progress() {
    for (Request* r : reqs)
      if (r->pending()) r->test();
  }
};

// The key/value blocks going round the ring, k and v as two messages. Step 0 reads the rank's
// own k and v (no copy when they are contiguous); step i receives block i + 1 into one of two
// buffers (only one with N = 2) while block i computes and is sent on.
template <class E>
class KvRing {
 public:
  KvRing(Communicator& comm, const RingDims& d, const Tensor& k, const Tensor& v)
      : comm_(comm), d_(d), kc_(k.contiguous()), vc_(v.contiguous()) {
    k_ = static_cast<const E*>(kc_.raw_data());
    v_ = static_cast<const E*>(vc_.raw_data());
    k_elems_ = d.B * d.S * d.D;
    v_elems_ = d.B * d.S * d.Dv;
  }
  const E* k() const { return k_; }
  const E* v() const { return v_; }

  // Posts the receive of the next block and the send of this one (none at the last step).
  void start(int step) {
    if (step + 1 >= d_.N) return;
    const int next = (d_.rank + 1) % d_.N, prev = (d_.rank + d_.N - 1) % d_.N;
    std::vector<E>& in = buf_[step % 2];
    in.resize(static_cast<size_t>(k_elems_ + v_elems_));
    rk_ = comm_.irecv(std::as_writable_bytes(std::span<E>(in.data(), k_elems_)), prev, kTagK);
    rv_ = comm_.irecv(std::as_writable_bytes(std::span<E>(in.data() + k_elems_, v_elems_)), prev,
                      kTagV);
    sk_ = comm_.isend(std::as_bytes(std::span<const E>(k_, k_elems_)), next, kTagK);
    sv_ = comm_.isend(std::as_bytes(std::span<const E>(v_, v_elems_)), next, kTagV);
  }
  std::vector<Request*> requests() { return {&rk_, &rv_, &sk_, &sv_}; }
  // Waits for this step's messages and moves on to the received block.
  void finish(int step) {
    if (step + 1 >= d_.N) return;
    rk_.wait(), rv_.wait(), sk_.wait(), sv_.wait();
    k_ = buf_[step % 2].data();
    v_ = k_ + k_elems_;
  }

 private:
  static constexpr int kTagK = 7101, kTagV = 7103;
  Communicator& comm_;
  const RingDims& d_;
  Tensor kc_, vc_;
  const E *k_ = nullptr, *v_ = nullptr;
  int64_t k_elems_ = 0, v_elems_ = 0;
  std::vector<E> buf_[2];
  Request rk_, rv_, sk_, sv_;
};

template <class E>
AttentionResult forward_impl(Context& ctx, Communicator& comm, const Tensor& q, const Tensor& k,
                             const Tensor& v, const Tensor& valid_lens, const RingOptions& opts,
                             const RingDims& d) {
  const int N = d.N, r = d.rank;
  const int64_t B = d.B, T = d.T, S = d.S, D = d.D, Dv = d.Dv;
  const DType dt = q.dtype();
  const std::vector<int32_t> gkept = global_kept(valid_lens, opts, d);
  bool any_empty = false;
  const std::vector<uint8_t> empty = empty_rows(gkept, d, &any_empty);
  const bool uniform = any_empty && opts.masked_rows == MaskedRowPolicy::kUniform;

  AttentionResult result;
  result.dropout_offset =
      opts.training && opts.dropout > 0.0 ? ctx.next_dropout_offset() : 0;  // as SDPA
  const RingDropout drop(ctx, d, opts, result.dropout_offset);
  result.output = Tensor::zeros({B, T, Dv}, dt);
  result.logsumexp = Tensor::full({B, T}, -std::numeric_limits<double>::infinity(), DType::F32);
  // The float32 accumulator of the output: the output itself for float32.
  std::vector<float> o_buf;
  float* o_acc = float_accumulator<E>(result.output, o_buf);
  float* l_acc = result.logsumexp.data<float>();
  // The kUniform rows' sum of (dropped) values: per batch row, or per row with dropout.
  const bool drop_uniform = uniform && drop.active;
  std::vector<double> vsum(uniform ? static_cast<size_t>((drop_uniform ? B * T : B) * Dv) : 0, 0.0);
  const std::vector<Segment> qsegs = segments(d.layout, r, N, T);
  const std::vector<int64_t> qglob =
      drop_uniform ? global_rows(d.layout, r, N, T) : std::vector<int64_t>();

  KvRing<E> ring(comm, d, k, v);
  kernels::AttentionArgs<E> p = base_args<E>(ctx, d, opts);
  drop.set(p);
  const kernels::StridedView<const E> qv = detail::head_view<const E>(q, 1);
  std::vector<int32_t> kept;
  std::vector<E> tmp_out;
  std::vector<float> tmp_lse;

  for (int i = 0; i < N; ++i) {
    ring.start(i);  // the next block is in flight while this one computes
    Pending pending{ring.requests()};
    const int owner = (r - i + N) % N;
    const E* kb = ring.k();
    const E* vb = ring.v();
    for (const Segment& a : qsegs) {
      for (const Segment& ks : segments(d.layout, owner, N, S)) {
        if (opts.causal && ks.global > a.global) continue;  // every key after every query
        const int64_t step = piece_rows(a.len);
        for (int64_t t0 = 0; t0 < a.len; t0 += step) {
          const int64_t m = std::min(step, a.len - t0);
          if (!piece_kept(d, opts, gkept, a, t0, m, ks, kept)) continue;
          tmp_out.resize(static_cast<size_t>(B * m * Dv));
          tmp_lse.resize(static_cast<size_t>(B * m));
          p.T = m, p.S = ks.len;
          p.kept_keys = kept.data();
          drop.place(p, a.global + t0, ks.global);
          p.q = qv;
          p.q.data += (a.local + t0) * qv.st;
          p.k = {kb + ks.local * D, S * D, 0, D, 1};
          p.v = {vb + ks.local * Dv, S * Dv, 0, Dv, 1};
          p.out = {tmp_out.data(), m * Dv, 0, Dv, 1};
          p.lse = tmp_lse.data();
          detail::fused_forward(p);
          // out = (w_acc out_acc + w_blk out_blk) with weights exp(lse - lse_new).
          for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < m; ++t) {
              const float lb = tmp_lse[b * m + t];
              if (lb == kNegInf) continue;
              const int64_t row = b * T + a.local + t0 + t;
              float* o = o_acc + row * Dv;
              const E* ob = tmp_out.data() + (b * m + t) * Dv;
              const float la = l_acc[row];
              const float mx = std::max(la, lb);
              const float wa = la == kNegInf ? 0.0f : std::exp(la - mx);
              const float wb = std::exp(lb - mx), inv = 1.0f / (wa + wb);
              for (int64_t e = 0; e < Dv; ++e)
                o[e] = (wa * o[e] + wb * to_f(ob[e])) * inv;
              l_acc[row] = mx + std::log(wa + wb);
            }
          pending.progress();
        }
      }
    }
    if (drop_uniform) {  // each empty row's own dropped sum of the block's values
      const std::vector<int64_t> kglob = global_rows(d.layout, owner, N, S);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
          if (!empty[b * T + t]) continue;
          double* acc = vsum.data() + (b * T + t) * Dv;
          for (int64_t s = 0; s < S; ++s) {
            const float z = drop.z(b, qglob[t], kglob[s]);
            if (z == 0.0f) continue;
            for (int64_t e = 0; e < Dv; ++e)
              acc[e] += static_cast<double>(z) * to_f(vb[(b * S + s) * Dv + e]);
          }
        }
    } else if (uniform) {  // the sum of every global value, for rows that keep no key (d2l)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t e = 0; e < Dv; ++e)
            vsum[b * Dv + e] += to_f(vb[(b * S + s) * Dv + e]);
    }
    ring.finish(i);
  }

  E* out = static_cast<E*>(result.output.raw_data());
  const double inv_s = 1.0 / static_cast<double>(d.S_global());
  for (int64_t row = 0; row < B * T; ++row) {
    const bool fix = uniform && empty[row];
    if (std::is_same_v<E, float> && !fix) continue;  // accumulated in place
    for (int64_t e = 0; e < Dv; ++e)
      out[row * Dv + e] =
          from_f<E>(fix ? static_cast<float>(vsum[(drop_uniform ? row : row / T) * Dv + e] * inv_s)
                        : o_acc[row * Dv + e]);
  }
  return result;
}

template <class E>
AttentionGrads backward_impl(Context& ctx, Communicator& comm, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& valid_lens,
                             const Tensor& out, const Tensor& lse, uint64_t dropout_offset,
                             const RingOptions& opts, const RingDims& d) {
  const int N = d.N, r = d.rank, next = (r + 1) % N, prev = (r + N - 1) % N;
  const int64_t B = d.B, T = d.T, S = d.S, D = d.D, Dv = d.Dv;
  const DType dt = q.dtype();
  const std::vector<int32_t> gkept = global_kept(valid_lens, opts, d);
  bool any_empty = false;
  const std::vector<uint8_t> empty = empty_rows(gkept, d, &any_empty);
  const bool uniform = any_empty && opts.masked_rows == MaskedRowPolicy::kUniform;

  const RingDropout drop(ctx, d, opts, dropout_offset);
  const bool drop_uniform = uniform && drop.active;
  // u[b] = sum of dout over the rows that keep no key, / S: their weight on every key (d2l).
  // With dropout each such row's weights differ: u[row] = dout[row] / S, times z per key.
  std::vector<float> u(uniform ? static_cast<size_t>((drop_uniform ? B * T : B) * Dv) : 0, 0.0f);
  const std::vector<int64_t> qglob =
      drop_uniform ? global_rows(d.layout, r, N, T) : std::vector<int64_t>();
  if (drop_uniform) {
    const Tensor dc = dout.to(DType::F32).contiguous();
    const float* g = dc.data<float>();
    const double inv_s = 1.0 / static_cast<double>(d.S_global());
    for (int64_t row = 0; row < B * T; ++row)
      if (empty[row])
        for (int64_t e = 0; e < Dv; ++e)
          u[row * Dv + e] = static_cast<float>(g[row * Dv + e] * inv_s);
  } else if (uniform) {
    const Tensor dc = dout.to(DType::F32).contiguous();
    const float* g = dc.data<float>();
    const double inv_s = 1.0 / static_cast<double>(d.S_global());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t e = 0; e < Dv; ++e) {
        double sum = 0;
        for (int64_t t = 0; t < T; ++t)
          if (empty[b * T + t]) sum += g[(b * T + t) * Dv + e];
        u[b * Dv + e] = static_cast<float>(sum * inv_s);
      }
  }

  AttentionGrads grads;
  grads.dq = Tensor::zeros({B, T, D}, dt);
  // dq's float32 accumulator: dq itself for float32.
  std::vector<float> dq_buf;
  float* dq_acc = float_accumulator<E>(grads.dq, dq_buf);

  // The travelling block's dk (B, S, D) then dv (B, S, Dv) in float32: this step's sum (acc),
  // the sum received from the previous rank (acc_in) and the one being sent on (acc_send).
  const int64_t k_elems = B * S * D, blk_elems = k_elems + B * S * Dv;
  std::vector<float> acc(static_cast<size_t>(blk_elems)), acc_in(static_cast<size_t>(blk_elems)),
      acc_send(static_cast<size_t>(blk_elems));
  Request sent;

  const std::vector<Segment> qsegs = segments(d.layout, r, N, T);
  KvRing<E> ring(comm, d, k, v);
  kernels::AttentionArgs<E> p = base_args<E>(ctx, d, opts);
  drop.set(p);
  const kernels::StridedView<const E> qv = detail::head_view<const E>(q, 1);
  const kernels::StridedView<E> ov = detail::head_view<E>(out, 1);
  const kernels::StridedView<const E> gv = detail::head_view<const E>(dout, 1);
  const float* lse_all = lse.data<float>();
  std::vector<int32_t> kept;
  std::vector<float> lse_piece;
  const int64_t seg_max = segments(d.layout, 0, N, S)[0].len;
  std::vector<E> dq_t, dk_t(static_cast<size_t>(B * seg_max * D)),
      dv_t(static_cast<size_t>(B * seg_max * Dv));

  for (int i = 0; i < N; ++i) {
    ring.start(i);
    Request gr;  // the block's gradient sums so far, from the ranks it visited before
    if (i > 0) gr = comm.irecv(std::as_writable_bytes(std::span<float>(acc_in)), prev, kTagGrad);
    Pending pending{ring.requests()};
    pending.reqs.push_back(&gr);
    pending.reqs.push_back(&sent);
    std::fill(acc.begin(), acc.end(), 0.0f);
    const int owner = (r - i + N) % N;
    const E* kb = ring.k();
    const E* vb = ring.v();
    for (const Segment& a : qsegs) {
      for (const Segment& ks : segments(d.layout, owner, N, S)) {
        if (opts.causal && ks.global > a.global) continue;
        const int64_t step = piece_rows(a.len), n = ks.len;
        for (int64_t t0 = 0; t0 < a.len; t0 += step) {
          const int64_t m = std::min(step, a.len - t0);
          if (!piece_kept(d, opts, gkept, a, t0, m, ks, kept)) continue;
          const int64_t row0 = a.local + t0;
          lse_piece.resize(static_cast<size_t>(B * m));
          for (int64_t b = 0; b < B; ++b)
            std::copy_n(lse_all + b * T + row0, m, lse_piece.data() + b * m);
          dq_t.resize(static_cast<size_t>(B * m * D));
          p.T = m, p.S = n;
          p.kept_keys = kept.data();
          drop.place(p, a.global + t0, ks.global);
          p.q = qv;
          p.q.data += row0 * qv.st;
          p.k = {kb + ks.local * D, S * D, 0, D, 1};
          p.v = {vb + ks.local * Dv, S * Dv, 0, Dv, 1};
          p.out = ov;
          p.out.data += row0 * ov.st;
          p.lse = lse_piece.data();
          kernels::AttentionGradArgs<E> g;
          g.dout = gv;
          g.dout.data += row0 * gv.st;
          g.dq = {dq_t.data(), m * D, 0, D, 1};
          g.dk = {dk_t.data(), n * D, 0, D, 1};
          g.dv = {dv_t.data(), n * Dv, 0, Dv, 1};
          detail::fused_backward(p, g);
          for (int64_t b = 0; b < B; ++b) {
            float* dq = dq_acc + (b * T + row0) * D;
            const E* src = dq_t.data() + b * m * D;
            for (int64_t j = 0; j < m * D; ++j)
              dq[j] += to_f(src[j]);
            float* dk = acc.data() + (b * S + ks.local) * D;
            float* dv = acc.data() + k_elems + (b * S + ks.local) * Dv;
            const E* sk = dk_t.data() + b * n * D;
            const E* sv = dv_t.data() + b * n * Dv;
            for (int64_t j = 0; j < n * D; ++j)
              dk[j] += to_f(sk[j]);
            for (int64_t j = 0; j < n * Dv; ++j)
              dv[j] += to_f(sv[j]);
          }
          pending.progress();
        }
      }
    }
    if (drop_uniform) {
      const std::vector<int64_t> kglob = global_rows(d.layout, owner, N, S);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
          if (!empty[b * T + t]) continue;
          const float* ur = u.data() + (b * T + t) * Dv;
          for (int64_t s = 0; s < S; ++s) {
            const float z = drop.z(b, qglob[t], kglob[s]);
            if (z == 0.0f) continue;
            float* dv = acc.data() + k_elems + (b * S + s) * Dv;
            for (int64_t e = 0; e < Dv; ++e)
              dv[e] += z * ur[e];
          }
        }
    } else if (uniform) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t e = 0; e < Dv; ++e)
            acc[k_elems + (b * S + s) * Dv + e] += u[b * Dv + e];
    }
    if (i > 0) {
      gr.wait();
      for (int64_t j = 0; j < blk_elems; ++j)
        acc[j] += acc_in[j];
    }
    // On to the next rank (after the last step: home to the block's owner). The previous step's
    // send has had a whole step to complete.
    sent.wait();
    std::swap(acc, acc_send);
    sent = comm.isend(std::as_bytes(std::span<const float>(acc_send)), next, kTagGrad);
    ring.finish(i);
  }
  std::vector<float>().swap(acc);  // released before the home message's buffer
  std::vector<float>().swap(acc_in);

  // The rank's own block comes home: dk, dv (float32: received straight into their storage).
  std::vector<float> home_buf;
  float* home = nullptr;
  Tensor home_t;
  if constexpr (std::is_same_v<E, float>) {
    home_t = Tensor::empty({blk_elems}, DType::F32);
    home = home_t.data<float>();
  } else {
    home_buf.resize(static_cast<size_t>(blk_elems));
    home = home_buf.data();
  }
  comm.recv(std::as_writable_bytes(std::span<float>(home, static_cast<size_t>(blk_elems))), prev,
            kTagGrad);
  sent.wait();

  if constexpr (std::is_same_v<E, float>) {
    grads.dk = home_t.slice(0, 0, k_elems).reshape({B, S, D});
    grads.dv = home_t.slice(0, k_elems, blk_elems).reshape({B, S, Dv});
  } else {
    for (int64_t j = 0; j < B * T * D; ++j)
      static_cast<E*>(grads.dq.raw_data())[j] = from_f<E>(dq_acc[j]);
    grads.dk = Tensor::empty({B, S, D}, dt);
    grads.dv = Tensor::empty({B, S, Dv}, dt);
    E* dk = static_cast<E*>(grads.dk.raw_data());
    E* dv = static_cast<E*>(grads.dv.raw_data());
    for (int64_t j = 0; j < k_elems; ++j)
      dk[j] = from_f<E>(home[j]);
    for (int64_t j = 0; j < blk_elems - k_elems; ++j)
      dv[j] = from_f<E>(home[k_elems + j]);
  }
  return grads;
}

}  // namespace

const char* ring_layout_name(RingLayout layout) {
  return layout == RingLayout::kZigzag ? "zigzag" : "contiguous";
}

AttentionResult ring_attention(Context& ctx, Communicator& comm, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& valid_lens, const RingOptions& opts) {
  const RingDims d = check_ring(kRing, ctx, comm, q, k, v, valid_lens, opts);
  if (q.dtype() == DType::BF16)
    return forward_impl<uint16_t>(ctx, comm, q, k, v, valid_lens, opts, d);
  return forward_impl<float>(ctx, comm, q, k, v, valid_lens, opts, d);
}

AttentionGrads ring_attention_backward(Context& ctx, Communicator& comm, const Tensor& dout,
                                       const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& valid_lens, const AttentionResult& forward,
                                       const RingOptions& opts) {
  const RingDims d = check_ring(kRingBackward, ctx, comm, q, k, v, valid_lens, opts, &dout,
                                forward.dropout_offset);
  const Tensor& fo = forward.output;
  const Tensor& fl = forward.logsumexp;
  check(fo.defined() && fl.defined() && fo.dtype() == q.dtype() && fl.dtype() == DType::F32 &&
            fo.shape() == Shape{d.B, d.T, d.Dv} && fl.shape() == Shape{d.B, d.T},
        kRingBackward,
        "forward result has output {} and logsumexp {}, expected ring_attention's: output "
        "(B, T_local, Dv) = {} of q's dtype and float32 logsumexp {}",
        shape_arg(fo), shape_arg(fl), shape_arg(Shape{d.B, d.T, d.Dv}), shape_arg(Shape{d.B, d.T}));
  const Tensor lse = fl.contiguous();
  if (q.dtype() == DType::BF16)
    return backward_impl<uint16_t>(ctx, comm, dout, q, k, v, valid_lens, fo, lse,
                                   forward.dropout_offset, opts, d);
  return backward_impl<float>(ctx, comm, dout, q, k, v, valid_lens, fo, lse, forward.dropout_offset,
                              opts, d);
}

// --- sharding helpers -------------------------------------------------------------------------

namespace {

constexpr const char* kShard = "ring_shard";

int norm_dim(const char* op, const Tensor& t, int dim) {
  check(t.defined(), op, "tensor is undefined");
  const int nd = t.ndim();
  const int dd = dim < 0 ? dim + nd : dim;
  check(dd >= 0 && dd < nd, op, "dim {} is out of range for shape {}", dim, shape_arg(t.shape()));
  return dd;
}

int64_t pieces(RingLayout layout, int size) {
  return layout == RingLayout::kZigzag ? 2 * static_cast<int64_t>(size) : size;
}

}  // namespace

Tensor ring_shard(const Tensor& global, int rank, int size, RingLayout layout, int dim) {
  const int dd = norm_dim(kShard, global, dim);
  check(size >= 1 && rank >= 0 && rank < size, kShard, "rank {} of {} ranks is out of range", rank,
        size);
  const int64_t L = global.dim(dd), n = pieces(layout, size);
  check(L % n == 0, kShard,
        "length {} along dim {} of {} does not divide into {} equal parts ({} layout, {} ranks): "
        "expected a multiple of {}",
        L, dd, shape_arg(global.shape()), n, ring_layout_name(layout), size, n);
  Shape shape = global.shape();
  shape[dd] = L / size;
  Tensor out = Tensor::empty(shape, global.dtype());
  for (const Segment& s : segments(layout, rank, size, L / size))
    out.slice(dd, s.local, s.local + s.len).copy_from(global.slice(dd, s.global, s.global + s.len));
  return out;
}

Tensor ring_unshard(const std::vector<Tensor>& shards, RingLayout layout, int dim) {
  constexpr const char* op = "ring_unshard";
  check(!shards.empty(), op, "no shards, expected one per rank");
  const int N = static_cast<int>(shards.size());
  const int dd = norm_dim(op, shards[0], dim);
  for (const Tensor& s : shards)
    check(s.defined() && s.shape() == shards[0].shape() && s.dtype() == shards[0].dtype(), op,
          "shards differ: {} {} and {} {}, expected one shape and dtype", shape_arg(s),
          dtype_name(s.dtype()), shape_arg(shards[0].shape()), dtype_name(shards[0].dtype()));
  const int64_t L = shards[0].dim(dd);
  check(layout == RingLayout::kContiguous || L % 2 == 0, op,
        "shard length {} is odd, the zigzag layout holds two equal chunks per rank", L);
  Shape shape = shards[0].shape();
  shape[dd] = L * N;
  Tensor out = Tensor::empty(shape, shards[0].dtype());
  for (int r = 0; r < N; ++r)
    for (const Segment& s : segments(layout, r, N, L))
      out.slice(dd, s.global, s.global + s.len)
          .copy_from(shards[r].slice(dd, s.local, s.local + s.len));
  return out;
}

Tensor ring_gather(Communicator& comm, const Tensor& local, RingLayout layout, int dim) {
  constexpr const char* op = "ring_gather";
  check(local.defined(), op, "tensor is undefined");
  std::vector<int64_t> desc(local.shape().begin(), local.shape().end());
  desc.push_back(static_cast<int64_t>(local.dtype()));
  comm.check_same(op, "shape and dtype of the shards", desc);
  std::vector<Tensor> shards;
  for (int r = 0; r < comm.size(); ++r) {
    Tensor t = r == comm.rank() ? local.clone() : Tensor::empty(local.shape(), local.dtype());
    comm.broadcast(t.raw_data(), static_cast<int64_t>(t.nbytes()), r);
    shards.push_back(std::move(t));
  }
  return ring_unshard(shards, layout, dim);
}

}  // namespace attn
