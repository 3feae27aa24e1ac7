// Module: a layer that owns parameters, runs forward and backward, and saves/loads state dicts.
//
// Backward is written by hand per layer, beside its forward (no autograd tape): forward keeps the
// activations its backward needs as named members, backward(dout) returns the input gradients and
// ACCUMULATES parameter gradients into Parameter::grad (zero_grad() clears them), as PyTorch does.
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/rng.hpp"
#include "attn/core/tensor.hpp"

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace attn::nn {

struct Parameter {
  Tensor value;  // undefined until a lazy layer sees its first input or a state dict
  Tensor grad;   // same shape as value; allocated (zeros) with the value
  // For a lazy parameter (value undefined): the shape load_state_dict accepts, -1 for the
  // dimensions the first input fixes (a LazyLinear weight is (out, -1)). Empty: any shape.
  Shape lazy_shape;
};

// Name -> tensor, names as in PyTorch's state_dict of the d2l model ("W_q.weight", ...).
using StateDict = std::map<std::string, Tensor>;

class Module {
 public:
  virtual ~Module() = default;

  // Parameters in registration order with their state-dict names; children are prefixed
  // ("attention.W_q.weight").
  virtual std::vector<std::pair<std::string, Parameter*>> named_parameters() = 0;

  // Copies of all parameter values (float tensors of the module's dtype). A lazy parameter that
  // has not been materialised yet has no value and is left out.
  StateDict state_dict();
  // Loads every parameter from `dict`. strict: missing or unexpected names are errors; shapes
  // must always match (a lazy parameter takes the shape it is given). Nothing is modified when
  // anything is wrong. Modules override to accept alternative names (PyTorch's packed MHA).
  virtual void load_state_dict(const StateDict& dict, bool strict = true);

  virtual void train(bool on = true) { training_ = on; }
  void eval() { train(false); }
  bool training() const { return training_; }
  void zero_grad();
  DType dtype() const { return dtype_; }
  int64_t num_parameters();

 protected:
  explicit Module(DType dtype) : dtype_(dtype) {}
  DType dtype_;
  bool training_ = true;  // PyTorch modules start in training mode
};

// Appends child's parameters to `out` with "prefix." in front of each name.
void append_parameters(std::vector<std::pair<std::string, Parameter*>>& out,
                       const std::string& prefix, Module& child);

// torch.nn.Linear / LazyLinear: y = x W^T + b, W (out, in), b (out).
// in_features == 0 makes it lazy: W is created at the first forward (or load_state_dict).
// Initialisation as PyTorch: W and b ~ U(-1/sqrt(in), 1/sqrt(in)).
// dtype F32, F64 or BF16. BF16 is a PyTorch Linear after .to(torch.bfloat16): the float32 draw
// rounded to bf16, inputs, outputs and gradients (weight.grad, bias.grad) all BF16.
class Linear : public Module {
 public:
  Linear(int64_t out_features, int64_t in_features, bool bias, DType dtype = DType::F32,
         uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;

  Tensor forward(Context& ctx, const Tensor& x);    // (..., in) -> (..., out)
  Tensor backward(Context& ctx, const Tensor& dy);  // returns dx; accumulates dW, db
  // With ctx.autocast_bf16 on a float32 layer, x may be float32 or bfloat16: the product runs in
  // bf16 on x and the weights rounded to bf16 (torch.autocast's linear) and y has x's dtype
  // (a bf16 y as computed; a float32 y widened from it). The backward takes dy in either dtype,
  // returns dx in x's dtype and accumulates the bf16 weight gradients widened to float32.

  // The same, with y in `y_dtype`: the module's dtype, or under autocast F32 or BF16 whatever
  // x's dtype (a float32 x giving a bf16 y keeps an activation that only feeds another bf16
  // product in bf16, e.g. the FFN's hidden layer: no widening here and no rounding there, the
  // same bits as the float32 round trip). The backward is unchanged: dy in either dtype, dx in
  // x's dtype.
  Tensor forward(Context& ctx, const Tensor& x, DType y_dtype);

  // relu(forward(x, y_dtype)), the same bits, with ReLU applied to the product's rows in its own
  // parallel region (ops linear_relu), and the backward of a layer whose input came out of a ReLU:
  // backward(dy) taken through ReLU's backward at relu_out (the ReLU's output, this layer's
  // input in the forward), dx = relu_backward(dy W, relu_out), in dx's product region. d2l's
  // PositionWiseFFN: dense1.forward_relu, dense2.backward_relu.
  Tensor forward_relu(Context& ctx, const Tensor& x, DType y_dtype);
  Tensor backward_relu(Context& ctx, const Tensor& dy, const Tensor& relu_out);

  // Creates W (and b) for `in_features` inputs if still lazy; checks the width otherwise.
  void materialize(int64_t in_features, const char* op);
  // 0 while lazy; a loaded state dict fixes it as the first input does.
  int64_t in_features() const { return weight.value.defined() ? weight.value.dim(1) : 0; }
  int64_t out_features() const { return out_features_; }
  bool has_bias() const { return has_bias_; }

  Parameter weight, bias;

 private:
  int64_t out_features_, in_features_;
  bool has_bias_;
  uint64_t seed_;
  Tensor forward_impl(Context& ctx, const Tensor& x, DType y_dtype, bool relu_after);
  Tensor backward_impl(Context& ctx, const Tensor& dy, const Tensor& relu_out);

  Tensor x_;  // saved input (bf16 under autocast)
  // Under autocast: the bf16 copies of the weights the forward used, and the dtype x came in.
  Tensor w_bf16_, b_bf16_;
  DType x_dtype_ = DType::F32;
  bool autocast_ = false;
};

}  // namespace attn::nn
