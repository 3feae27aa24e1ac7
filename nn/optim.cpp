// SGD (momentum), AdamW and clip_grad_norm with PyTorch's update rules, and optimiser state as
// named tensors. Each update reads and writes one parameter element at a time in double, so the
// result does not depend on threads or vector widths, and a resumed run repeats bit for bit.
// BF16 parameters (a module built with DType::BF16, PyTorch's module.to(torch.bfloat16)) keep
// BF16 state, as torch.optim does; each stored value is rounded once from the double result.
#include "attn/nn/optim.hpp"

#include "kernels/cpu/parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <type_traits>
#include <vector>

namespace attn::nn {

namespace {

bool has_grad(const Parameter& p) {
  return p.value.defined() && p.grad.defined();
}

// One bfloat16 element as the update loops see it: read as double, assigned from double with
// one rounding to nearest even (not double -> float -> bf16, which can round twice: a float that
// lands exactly halfway between two bf16 values is moved toward the double first).
struct Bf16 {
  uint16_t bits;
  Bf16(double x) : bits(round(x)) {}  // NOLINT(google-explicit-constructor): T(double) below
  operator double() const { return bf16_to_float(bits); }
  static uint16_t round(double x) {
    float f = static_cast<float>(x);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0xffffu) == 0x8000u && std::isfinite(f) && static_cast<double>(f) != x) {
      u = (x > static_cast<double>(f)) == (f > 0.0f) ? u + 1 : u - 1;  // off the tie, toward x
      std::memcpy(&f, &u, 4);
    }
    return float_to_bf16(f);
  }
};
static_assert(sizeof(Bf16) == 2);

// Runs f(value*, grad*, n) typed as the parameter's dtype (value and grad contiguous: they are
// allocated that way by every module).
template <typename F>
void with_typed(const Parameter& p, F&& f) {
  if (p.value.dtype() == DType::F32)
    f(p.value.data<float>(), p.grad.data<float>(), p.value.numel());
  else if (p.value.dtype() == DType::BF16)
    f(static_cast<Bf16*>(p.value.raw_data()), static_cast<Bf16*>(p.grad.raw_data()),
      p.value.numel());
  else
    f(p.value.data<double>(), p.grad.data<double>(), p.value.numel());
}

template <typename T>
T* buffer_data(const Tensor& t) {
  if constexpr (std::is_same_v<T, Bf16>) {
    check(t.dtype() == DType::BF16, "optimizer", "state has dtype {}, expected BF16",
          dtype_name(t.dtype()));
    return static_cast<Bf16*>(t.raw_data());
  } else {
    return t.data<T>();
  }
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Optimizer: parameters, zero_grad, state dicts

Optimizer::Optimizer(NamedParameters params, double lr_, const char* name)
    : lr(lr_), buffers_(params.size()), params_(std::move(params)), name_(name) {
  check(std::isfinite(lr_) && lr_ >= 0.0, name, "lr is {}, expected a finite number >= 0", lr_);
  std::set<std::string> seen;
  for (const auto& [n, p] : params_) {
    check(p != nullptr, name, "parameter '{}' is null", n);
    check(seen.insert(n).second, name, "parameter '{}' is listed twice", n);
    check(!p->value.defined() || p->value.dtype() == DType::F32 || p->value.dtype() == DType::F64 ||
              p->value.dtype() == DType::BF16,
          name, "parameter '{}' has dtype {}, expected F32, F64 or BF16", n,
          dtype_name(p->value.dtype()));
  }
}

void Optimizer::zero_grad() {
  for (auto& [n, p] : params_) {
    if (!p->grad.defined()) continue;
    // All-zero bytes are +0.0 in F32, F64 and BF16: one memset instead of a per-element fill.
    if (p->grad.is_contiguous())
      std::memset(p->grad.raw_data(), 0, p->grad.nbytes());
    else
      p->grad.fill(0.0);
  }
}

StateDict Optimizer::state_dict() const {
  StateDict dict;
  for (size_t i = 0; i < params_.size(); ++i)
    for (const auto& [buf, t] : buffers_[i])
      dict.emplace(params_[i].first + "." + buf, t.clone());
  return dict;
}

void Optimizer::load_state_dict(const StateDict& dict) {
  const std::string op = name_ + "::load_state_dict";
  std::vector<StateDict> staged(params_.size());
  std::set<std::string> used;
  const std::vector<std::string> names = buffer_names();
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = *params_[i].second;
    for (const std::string& buf : names) {
      const std::string key = params_[i].first + "." + buf;
      auto it = dict.find(key);
      if (it == dict.end()) continue;
      used.insert(key);
      const Tensor& t = it->second;
      check(t.defined() && is_floating(t.dtype()), op.c_str(), "'{}' must be a float tensor", key);
      check(p.value.defined(), op.c_str(),
            "'{}' is state for a parameter that has no value yet (a lazy layer before its first "
            "input)",
            key);
      // "step" is a one-element counter; every other buffer has the parameter's shape.
      const Shape want = buf == "step" ? Shape{1} : p.value.shape();
      check(t.shape() == want, op.c_str(), "'{}' has shape {}, expected {}", key,
            shape_arg(t.shape()), shape_arg(want));
      staged[i].emplace(buf, t.to(buf == "step" ? DType::F64 : p.value.dtype()).clone());
    }
  }
  for (const auto& [key, t] : dict)
    check(used.count(key) != 0, op.c_str(),
          "unexpected '{}': not a buffer of any parameter (buffers are <parameter>.{{{}}})", key,
          fmt::join(names, ","));
  buffers_ = std::move(staged);
}

// ----------------------------------------------------------------------------------------------
// SGD

SGD::SGD(NamedParameters params, const SGDOptions& o)
    : Optimizer(std::move(params), o.lr, "SGD"), options(o) {
  check(o.momentum >= 0.0 && o.weight_decay >= 0.0 && std::isfinite(o.dampening), "SGD",
        "momentum ({}) and weight_decay ({}) must be >= 0", o.momentum, o.weight_decay);
  check(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0), "SGD",
        "nesterov momentum requires a momentum > 0 and zero dampening");
}

void SGD::step() {
  const SGDOptions& o = options;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i].second;
    if (!has_grad(p)) continue;
    const bool use_momentum = o.momentum != 0.0;
    bool first = false;
    if (use_momentum && !buffers_[i].count("momentum_buffer")) {
      buffers_[i]["momentum_buffer"] = Tensor::zeros(p.value.shape(), p.value.dtype());
      first = true;
    }
    with_typed(p, [&](auto* w, auto* g, int64_t n) {
      using T = std::remove_pointer_t<decltype(w)>;
      T* buf = use_momentum ? buffer_data<T>(buffers_[i]["momentum_buffer"]) : nullptr;
      for (int64_t j = 0; j < n; ++j) {
        // g = grad + weight_decay * p  (L2 penalty folded into the gradient, as torch.optim.SGD)
        T d = static_cast<T>(static_cast<double>(g[j]) + o.weight_decay * w[j]);
        if (use_momentum) {
          // buf = g (first step) or momentum * buf + (1 - dampening) * g
          buf[j] = first ? d : static_cast<T>(o.momentum * buf[j] + (1.0 - o.dampening) * d);
          d = o.nesterov ? static_cast<T>(d + o.momentum * buf[j]) : buf[j];
        }
        w[j] = static_cast<T>(w[j] - lr * d);
      }
    });
  }
}

// ----------------------------------------------------------------------------------------------
// AdamW

AdamW::AdamW(NamedParameters params, const AdamWOptions& o)
    : Optimizer(std::move(params), o.lr, "AdamW"), options(o) {
  check(o.beta1 >= 0.0 && o.beta1 < 1.0 && o.beta2 >= 0.0 && o.beta2 < 1.0, "AdamW",
        "betas ({}, {}) must be in [0, 1)", o.beta1, o.beta2);
  check(o.eps >= 0.0 && o.weight_decay >= 0.0, "AdamW",
        "eps ({}) and weight_decay ({}) must be >= 0", o.eps, o.weight_decay);
}

namespace {

// AdamW's update of float32 parameters (every trainer's masters), the generic loop of step() below
// for T = float, term for term. The baseline x86-64 build ran it scalar (double sqrt and divide,
// ~6 ns per parameter, 2.4% of the encoder's training step); here it is compiled per target and
// vectorised. The same bits on every target because nn/optim.cpp is compiled with
// -ffp-contract=off (no FMA fused out of a*b + c on the AVX2 / AVX-512 clones, CMakeLists.txt)
// and -fno-math-errno (which lets sqrt vectorise; nothing reads errno); every lane runs the
// scalar's IEEE operations (tests/test_optim.cpp checks it bit for bit).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void adamw_update_f32(float* __restrict w, const float* __restrict g, float* __restrict m,
                      float* __restrict v, int64_t n, const AdamWOptions& o, double lr,
                      double step_size, double bias_correction2_sqrt) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const double gj = g[j];
    const double wj = static_cast<float>(w[j] * (1.0 - lr * o.weight_decay));
    m[j] = static_cast<float>(o.beta1 * m[j] + (1.0 - o.beta1) * gj);
    v[j] = static_cast<float>(o.beta2 * v[j] + (1.0 - o.beta2) * gj * gj);
    const double denom = std::sqrt(static_cast<double>(v[j])) / bias_correction2_sqrt + o.eps;
    w[j] = static_cast<float>(wj - step_size * m[j] / denom);
  }
}

// lanes[j % 8] = sum of g[j]^2 in double over j < n (n a multiple of 8 except in a
// parameter's last task), in four interleaved sets of 8 lanes (element j into set (j / 8) % 4)
// added together at the end, so that four chains of adds are in flight instead of one. A fixed
// order: compiled per target like adamw_update_f32 (this file is built with -ffp-contract=off,
// so no clone fuses the multiply and the add), the same bits.
constexpr int64_t kSquareLanes = 8, kSquareSets = 4;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void sum_squares_f32(const float* __restrict g, int64_t n, double* __restrict lanes) {
  double acc[kSquareSets][kSquareLanes] = {};
  int64_t j = 0;
  for (; j + kSquareSets * kSquareLanes <= n; j += kSquareSets * kSquareLanes) {
    for (int64_t s = 0; s < kSquareSets; ++s) {
#pragma omp simd
      for (int64_t k = 0; k < kSquareLanes; ++k) {
        const double x = g[j + s * kSquareLanes + k];
        acc[s][k] += x * x;
      }
    }
  }
  for (int64_t k = 0; j + k < n; ++k) {
    const double x = g[j + k];
    acc[(k / kSquareLanes) % kSquareSets][k % kSquareLanes] += x * x;
  }
  for (int64_t k = 0; k < kSquareLanes; ++k)
    lanes[k] = (acc[0][k] + acc[1][k]) + (acc[2][k] + acc[3][k]);
}

// clip_grad_norm's work, cut independently of the thread count: each gradient in tasks of
// kNormTask elements (a multiple of 8, so element j of a parameter stays in lane j % 8).
constexpr int64_t kNormTask = int64_t{1} << 14;
struct NormTask {
  Parameter* p;
  int64_t begin, end;
};

std::vector<NormTask> norm_tasks(const NamedParameters& params) {
  std::vector<NormTask> tasks;
  for (const auto& [n, p] : params) {
    if (!has_grad(*p)) continue;
    // Checked before the parallel loops (an exception must not leave an OpenMP region).
    check(p->grad.dtype() == p->value.dtype() && p->grad.numel() == p->value.numel() &&
              p->grad.is_contiguous(),
          "clip_grad_norm", "gradient of {} is {} {}, expected a contiguous {} of {} elements", n,
          dtype_name(p->grad.dtype()), shape_arg(p->grad.shape()), dtype_name(p->value.dtype()),
          p->value.numel());
    const int64_t count = p->grad.numel();
    for (int64_t b = 0; b < count; b += kNormTask)
      tasks.push_back({p, b, std::min(count, b + kNormTask)});
  }
  return tasks;
}

}  // namespace

void AdamW::step() {
  const AdamWOptions& o = options;
  // The per-parameter scalars first (buffers created, step counts advanced, in order), then the
  // elementwise updates, one parameter per task, side by side on up to `threads` threads.
  struct Update {
    size_t index;
    double step_size, bias_correction2_sqrt;
    int64_t numel;
  };
  std::vector<Update> updates;
  updates.reserve(params_.size());
  int64_t total = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i].second;
    if (!has_grad(p)) continue;
    StateDict& s = buffers_[i];
    if (!s.count("step")) {
      s["step"] = Tensor::zeros({1}, DType::F64);
      s["exp_avg"] = Tensor::zeros(p.value.shape(), p.value.dtype());
      s["exp_avg_sq"] = Tensor::zeros(p.value.shape(), p.value.dtype());
    }
    // Checked here, not inside the parallel loop (an exception must not leave an OpenMP region).
    check(s["exp_avg"].dtype() == p.value.dtype() && s["exp_avg_sq"].dtype() == p.value.dtype(),
          "AdamW::step", "state of {} has dtype {}, the parameter {}", params_[i].first,
          dtype_name(s["exp_avg"].dtype()), dtype_name(p.value.dtype()));
    double* step_count = s["step"].data<double>();
    *step_count += 1.0;
    const double t = *step_count;
    const double bias_correction1 = 1.0 - std::pow(o.beta1, t);
    updates.push_back(
        {i, lr / bias_correction1, std::sqrt(1.0 - std::pow(o.beta2, t)), p.value.numel()});
    total += p.value.numel();
  }
  auto update = [&](const Update& u) {
    Parameter& p = *params_[u.index].second;
    StateDict& s = buffers_[u.index];
    const double step_size = u.step_size, bias_correction2_sqrt = u.bias_correction2_sqrt;
    with_typed(p, [&](auto* w, auto* g, int64_t n) {
      using T = std::remove_pointer_t<decltype(w)>;
      T* m = buffer_data<T>(s.at("exp_avg"));
      T* v = buffer_data<T>(s.at("exp_avg_sq"));
      if constexpr (std::is_same_v<T, float>) {
        adamw_update_f32(w, g, m, v, n, o, lr, step_size, bias_correction2_sqrt);
        return;
      }
      for (int64_t j = 0; j < n; ++j) {
        const double gj = g[j];
        // Decoupled weight decay: shrink p before the Adam step, independent of the gradient.
        const double wj = static_cast<T>(w[j] * (1.0 - lr * o.weight_decay));
        m[j] = static_cast<T>(o.beta1 * m[j] + (1.0 - o.beta1) * gj);
        v[j] = static_cast<T>(o.beta2 * v[j] + (1.0 - o.beta2) * gj * gj);
        const double denom = std::sqrt(static_cast<double>(v[j])) / bias_correction2_sqrt + o.eps;
        w[j] = static_cast<T>(wj - step_size * m[j] / denom);
      }
    });
  };
  // Counted as 48 flops an element: a handful of multiply-adds, but a square root and a division
  // in double, which at AVX-512 throughput take 2-4 cycles an element. (Counted as 12, the d2l
  // encoder's 0.3M parameters updated on one thread while the other waited: ~0.15 ms a step.)
  const int team =
      std::min<int>(cpu::threads_for(48.0 * static_cast<double>(total), std::max(1, threads)),
                    static_cast<int>(updates.size()));
  const int64_t count = static_cast<int64_t>(updates.size());
  if (team <= 1) {
    for (const Update& u : updates)
      update(u);
    return;
  }
  // Largest first, taken dynamically: the shares even out whatever the sizes.
  std::stable_sort(updates.begin(), updates.end(),
                   [](const Update& a, const Update& b) { return a.numel > b.numel; });
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
  for (int64_t k = 0; k < count; ++k)
    update(updates[static_cast<size_t>(k)]);
}

// ----------------------------------------------------------------------------------------------
// clip_grad_norm

double clip_grad_norm(const NamedParameters& params, double max_norm, double norm_type,
                      int threads) {
  const char* op = "clip_grad_norm";
  check(std::isfinite(max_norm) && max_norm >= 0.0, op, "max_norm is {}, expected >= 0", max_norm);
  const bool inf_norm = std::isinf(norm_type) && norm_type > 0;
  check(inf_norm || norm_type == 2.0, op, "norm_type {} unsupported, expected 2 or inf", norm_type);
  // The norm of all gradients as one vector: sqrt(sum g^2) (or max |g|), summed in double.
  // Each task (a block of 16K elements of one gradient, the cut fixed by the sizes alone) sums
  // its squares in 8 lanes (element j into lane j % 8); the tasks' lanes are then added in task
  // order and the 8 lanes pairwise: a fixed order, so the same bits for any thread count and
  // SIMD target. A NaN gradient makes the sum NaN (its square is NaN); an infinite one makes it
  // infinite. The max norm is order-free.
  const std::vector<NormTask> tasks = norm_tasks(params);
  const int64_t count = static_cast<int64_t>(tasks.size());
  int64_t total = 0;
  for (const NormTask& t : tasks)
    total += t.end - t.begin;
  // Counted as 32 flops an element: the arithmetic is 3 (a widening, a multiply, an add), but
  // the gradients were just written by the backward's threads, so the reads come from the other
  // cores' caches at memory speed (one thread: ~50 us for the d2l encoder's 0.3M gradients).
  const int team = std::min<int64_t>(
      cpu::threads_for(32.0 * static_cast<double>(total), std::max(1, threads)), count);
  std::vector<double> sums(static_cast<size_t>(count) * kSquareLanes, 0.0);
#pragma omp parallel for schedule(static) num_threads(std::max(1, team)) if (team > 1)
  for (int64_t i = 0; i < count; ++i) {
    const NormTask& t = tasks[static_cast<size_t>(i)];
    double* lanes = sums.data() + i * kSquareLanes;
    // Through typed pointers (the gradients are contiguous, as step() assumes).
    with_typed(*t.p, [&](auto* w, auto* g, int64_t) {
      (void)w;
      if (!inf_norm) {
        if constexpr (std::is_same_v<std::remove_pointer_t<decltype(g)>, float>) {
          sum_squares_f32(g + t.begin, t.end - t.begin, lanes);
        } else {
          for (int64_t j = t.begin; j < t.end; ++j) {
            const double x = g[j];
            lanes[j % kSquareLanes] += x * x;
          }
        }
        return;
      }
      double m = 0.0;
      for (int64_t j = t.begin; j < t.end; ++j) {
        const double x = g[j];
        m = std::max(m, std::abs(x));
        if (std::isnan(x)) m = std::numeric_limits<double>::quiet_NaN();
      }
      lanes[0] = m;
    });
  }
  double acc = 0.0;
  if (inf_norm) {
    for (int64_t i = 0; i < count; ++i) {
      const double m = sums[static_cast<size_t>(i) * kSquareLanes];
      if (std::isnan(m) || std::isnan(acc))
        acc = std::numeric_limits<double>::quiet_NaN();
      else
        acc = std::max(acc, m);
    }
  } else {
    double lanes[kSquareLanes] = {};
    for (int64_t i = 0; i < count; ++i)
      for (int64_t k = 0; k < kSquareLanes; ++k)
        lanes[k] += sums[static_cast<size_t>(i * kSquareLanes + k)];
    acc = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
          ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
  const double total_norm = inf_norm ? acc : std::sqrt(acc);
  // torch: clip_coef = max_norm / (total + 1e-6), clamped to 1, multiplied into every gradient.
  const double coef = max_norm / (total_norm + 1e-6);
  if (coef < 1.0) {
#pragma omp parallel for schedule(static) num_threads(std::max(1, team)) if (team > 1)
    for (int64_t i = 0; i < count; ++i) {
      const NormTask& t = tasks[static_cast<size_t>(i)];
      with_typed(*t.p, [&](auto* w, auto* g, int64_t) {
        (void)w;
        using T = std::remove_pointer_t<decltype(g)>;
        for (int64_t j = t.begin; j < t.end; ++j)
          g[j] = static_cast<T>(g[j] * coef);
      });
    }
  }
  return total_norm;
}

}  // namespace attn::nn
