// rnn_tanh / rnn_tanh_backward: validation, then the reference kernel (kernels/ref/rnn.cpp).
#include "attn/ops/rnn.hpp"

#include "kernels/ref/rnn.hpp"
#include "ops/common.hpp"

namespace attn {
namespace {

struct RnnDims {
  int64_t B, N, I, H;
};

// x (B, n, I), h0 (B, H) or undefined, W_ih (H, I), W_hh (H, H).
RnnDims check_rnn(const char* op, const Tensor& x, const Tensor& h0, const Tensor& W_ih,
                  const Tensor& W_hh) {
  detail::check_float_tensor(op, "x", x);
  detail::check_float_tensor(op, "W_ih", W_ih);
  detail::check_float_tensor(op, "W_hh", W_hh);
  detail::check_ndim(op, "x", x, 3, "(B, n, input_size)");
  detail::check_ndim(op, "W_ih", W_ih, 2, "(hidden_size, input_size)");
  detail::check_ndim(op, "W_hh", W_hh, 2, "(hidden_size, hidden_size)");
  detail::check_same_dtype(op, "W_ih", W_ih, "x", x);
  detail::check_same_dtype(op, "W_hh", W_hh, "x", x);
  const RnnDims d{x.dim(0), x.dim(1), x.dim(2), W_ih.dim(0)};
  check(W_ih.dim(1) == d.I, op, "x {} and W_ih {} do not match, expected W_ih (H, {})",
        shape_str(x.shape()), shape_str(W_ih.shape()), d.I);
  check(W_hh.dim(0) == d.H && W_hh.dim(1) == d.H, op,
        "W_hh has shape {}, expected (H, H) = ({}, {}) from W_ih {}", shape_str(W_hh.shape()), d.H,
        d.H, shape_str(W_ih.shape()));
  if (h0.defined()) {
    detail::check_float_tensor(op, "h0", h0);
    detail::check_same_dtype(op, "h0", h0, "x", x);
    check(h0.shape() == Shape{d.B, d.H}, op, "h0 has shape {}, expected (B, H) = ({}, {})",
          shape_str(h0.shape()), d.B, d.H);
  }
  return d;
}

}  // namespace

RnnResult rnn_tanh(Context& ctx, const Tensor& x, const Tensor& h0, const Tensor& W_ih,
                   const Tensor& W_hh, const Tensor& b_ih, const Tensor& b_hh) {
  constexpr const char* op = "rnn_tanh";
  const RnnDims d = check_rnn(op, x, h0, W_ih, W_hh);
  check(b_ih.defined() == b_hh.defined(), op,
        "b_ih is {} but b_hh is {}: give both biases or neither",
        b_ih.defined() ? "given" : "undefined", b_hh.defined() ? "given" : "undefined");
  for (const auto& [name, bias] : {std::pair{"b_ih", &b_ih}, std::pair{"b_hh", &b_hh}}) {
    if (!bias->defined()) continue;
    detail::check_float_tensor(op, name, *bias);
    detail::check_same_dtype(op, name, *bias, "x", x);
    check(bias->ndim() == 1 && bias->dim(0) == d.H, op, "{} has shape {}, expected (H) = ({})",
          name, shape_str(bias->shape()), d.H);
  }
  (void)ctx;
  const Tensor xc = x.contiguous(), wi = W_ih.contiguous(), wh = W_hh.contiguous();
  const Tensor hc = h0.defined() ? h0.contiguous() : Tensor();
  const Tensor bi = b_ih.defined() ? b_ih.contiguous() : Tensor();
  const Tensor bh = b_hh.defined() ? b_hh.contiguous() : Tensor();
  RnnResult r;
  r.output = Tensor::empty({d.B, d.N, d.H}, x.dtype());
  const int64_t macs = detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    return ref::rnn_tanh_forward<F>(
        xc.data<F>(), hc.defined() ? hc.data<F>() : nullptr, wi.data<F>(), wh.data<F>(),
        bi.defined() ? bi.data<F>() : nullptr, bh.defined() ? bh.data<F>() : nullptr,
        r.output.data<F>(), d.B, d.N, d.I, d.H);
  });
  r.flops = 2 * macs;
  // h_n: the last state; for n = 0 the initial state (zeros without h0), as PyTorch.
  if (d.N > 0) {
    r.h_n = r.output.select(1, d.N - 1).clone();
  } else {
    r.h_n = hc.defined() ? hc.clone() : Tensor::zeros({d.B, d.H}, x.dtype());
  }
  return r;
}

RnnGrads rnn_tanh_backward(Context& ctx, const Tensor& dout, const Tensor& dh_n, const Tensor& x,
                           const Tensor& h0, const Tensor& W_ih, const Tensor& W_hh,
                           const Tensor& output, bool has_bias) {
  constexpr const char* op = "rnn_tanh_backward";
  const RnnDims d = check_rnn(op, x, h0, W_ih, W_hh);
  const Shape out_shape{d.B, d.N, d.H};
  for (const auto& [name, t] : {std::pair{"dout", &dout}, std::pair{"output", &output}}) {
    detail::check_float_tensor(op, name, *t);
    detail::check_same_dtype(op, name, *t, "x", x);
    check(t->shape() == out_shape, op, "{} has shape {}, expected (B, n, H) = {}", name,
          shape_str(t->shape()), shape_str(out_shape));
  }
  if (dh_n.defined()) {
    detail::check_float_tensor(op, "dh_n", dh_n);
    detail::check_same_dtype(op, "dh_n", dh_n, "x", x);
    check(dh_n.shape() == Shape{d.B, d.H}, op, "dh_n has shape {}, expected (B, H) = ({}, {})",
          shape_str(dh_n.shape()), d.B, d.H);
  }
  (void)ctx;
  const Tensor dc = dout.contiguous(), xc = x.contiguous(), wi = W_ih.contiguous(),
               wh = W_hh.contiguous(), oc = output.contiguous();
  const Tensor hc = h0.defined() ? h0.contiguous() : Tensor();
  const Tensor dhc = dh_n.defined() ? dh_n.contiguous() : Tensor();
  RnnGrads g;
  g.dx = Tensor::empty(x.shape(), x.dtype());
  g.dh0 = Tensor::empty({d.B, d.H}, x.dtype());
  g.dW_ih = Tensor::empty(W_ih.shape(), x.dtype());
  g.dW_hh = Tensor::empty(W_hh.shape(), x.dtype());
  if (has_bias) {
    g.db_ih = Tensor::empty({d.H}, x.dtype());
    g.db_hh = Tensor::empty({d.H}, x.dtype());
  }
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::rnn_tanh_backward<F>(dc.data<F>(), dhc.defined() ? dhc.data<F>() : nullptr, xc.data<F>(),
                              hc.defined() ? hc.data<F>() : nullptr, wi.data<F>(), wh.data<F>(),
                              oc.data<F>(), g.dx.data<F>(), g.dh0.data<F>(), g.dW_ih.data<F>(),
                              g.dW_hh.data<F>(), has_bias ? g.db_ih.data<F>() : nullptr,
                              has_bias ? g.db_hh.data<F>() : nullptr, d.B, d.N, d.I, d.H);
  });
  return g;
}

}  // namespace attn
