// Optimisers and gradient clipping over Module::named_parameters(), with PyTorch's update rules
// (torch.optim.SGD, torch.optim.AdamW, torch.nn.utils.clip_grad_norm_), and their state as
// named tensors so a trainer can checkpoint and resume bit-identically.
//
// A parameter whose value or grad is undefined (a lazy Linear before its first input) is skipped,
// as PyTorch skips parameters whose .grad is None. Parameters are F32, F64 or BF16. Updates are
// computed per element in double and rounded once to the parameter's dtype; optimiser state has
// the parameter's dtype (BF16 state for BF16 parameters, as torch.optim keeps it; PyTorch rounds
// after every tensor op of the update, attn once per stored value, so bf16 results can differ
// from PyTorch's in the last bit). No fp32 master copy is kept: as in PyTorch, an update smaller
// than half a bf16 step of the weight (2^-9 relative) is lost.
#pragma once

#include "attn/nn/module.hpp"

#include <string>
#include <utility>
#include <vector>

namespace attn::nn {

using NamedParameters = std::vector<std::pair<std::string, Parameter*>>;

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Applies one update from the current gradients.
  virtual void step() = 0;
  // Sets every gradient to zero (PyTorch's zero_grad(set_to_none=False)).
  void zero_grad();
  // The state as named tensors, "<parameter>.<buffer>" (e.g. "blks.block0.ffn.dense1.weight.
  // exp_avg"); hyperparameters are not included (the trainer's configuration holds them).
  virtual StateDict state_dict() const;
  // Replaces the state by `dict`'s. Every name must be a buffer this optimiser keeps for one of
  // its parameters, with that parameter's shape; nothing changes when anything is wrong.
  virtual void load_state_dict(const StateDict& dict);

  const NamedParameters& parameters() const { return params_; }
  double lr;
  // OpenMP threads step() may use (AdamW: parameters updated side by side). Every element's
  // update is the same arithmetic on any thread, so the results do not depend on it.
  int threads = 1;

 protected:
  Optimizer(NamedParameters params, double lr, const char* name);
  // Buffers by parameter index: buffers_[i][buffer name]. Created at a parameter's first step.
  std::vector<StateDict> buffers_;
  // The buffer names a parameter's state may hold (for validation in load_state_dict).
  virtual std::vector<std::string> buffer_names() const = 0;
  NamedParameters params_;
  std::string name_;
};

// torch.optim.SGD(params, lr, momentum, dampening, weight_decay, nesterov):
//   g = grad + weight_decay * p
//   if momentum != 0:  buf = g at the first step, else buf = momentum * buf + (1 - dampening) * g
//                      g = nesterov ? g + momentum * buf : buf
//   p = p - lr * g
// State: "<param>.momentum_buffer" (only with momentum).
struct SGDOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  SGD(NamedParameters params, const SGDOptions& options);
  void step() override;
  SGDOptions options;

 protected:
  std::vector<std::string> buffer_names() const override { return {"momentum_buffer"}; }
};

// torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
//   t = t + 1
//   p = p * (1 - lr * weight_decay)                       decoupled decay (Loshchilov & Hutter)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g^2
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// State per parameter: "<param>.step" (F64 (1)), "<param>.exp_avg", "<param>.exp_avg_sq".
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

class AdamW : public Optimizer {
 public:
  AdamW(NamedParameters params, const AdamWOptions& options = {});
  void step() override;
  AdamWOptions options;

 protected:
  std::vector<std::string> buffer_names() const override {
    return {"step", "exp_avg", "exp_avg_sq"};
  }
};

// torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type): the global norm of all
// gradients taken together (L2: sqrt(sum of squares); or the max |g| for norm_type = inf); when
// it exceeds max_norm every gradient is multiplied by max_norm / (norm + 1e-6). Returns the norm
// before clipping. Parameters without a gradient are skipped. Large gradients are summed and
// scaled on up to `threads` OpenMP threads, in a fixed order: the same bits for any count.
double clip_grad_norm(const NamedParameters& params, double max_norm, double norm_type = 2.0,
                      int threads = 1);

}  // namespace attn::nn
