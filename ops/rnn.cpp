// rnn_tanh / rnn_tanh_backward and gru / gru_backward: validation, then the reference kernels
// (kernels/ref/rnn.cpp).
#include "attn/ops/rnn.hpp"

#include "kernels/ref/rnn.hpp"
#include "ops/common.hpp"

namespace attn {
namespace {

struct RnnDims {
  int64_t B, N, I, H;
};

// The row blocks of W_ih, W_hh and the biases: one for the RNN, three (r, z, n) for the GRU.
struct Gates {
  int64_t count;       // 1 or 3
  const char* rows;    // "H" or "3H", for messages
  const char* layout;  // W_ih's layout, for messages
};
constexpr Gates kRnnGates{1, "H", "(hidden_size, input_size)"};
constexpr Gates kGruGates{3, "3H", "(3*hidden_size, input_size)"};

// x (B, n, I), h0 (B, H) or undefined, W_ih (gates*H, I), W_hh (gates*H, H).
RnnDims check_rnn(const char* op, const Tensor& x, const Tensor& h0, const Tensor& W_ih,
                  const Tensor& W_hh, const Gates& gates = kRnnGates) {
  detail::check_float_tensor(op, "x", x);
  detail::check_float_tensor(op, "W_ih", W_ih);
  detail::check_float_tensor(op, "W_hh", W_hh);
  detail::check_ndim(op, "x", x, 3, "(B, n, input_size)");
  detail::check_ndim(op, "W_ih", W_ih, 2, gates.layout);
  detail::check_ndim(
      op, "W_hh", W_hh, 2,
      gates.count == 1 ? "(hidden_size, hidden_size)" : "(3*hidden_size, hidden_size)");
  detail::check_same_dtype(op, "W_ih", W_ih, "x", x);
  detail::check_same_dtype(op, "W_hh", W_hh, "x", x);
  check(W_ih.dim(0) % gates.count == 0, op,
        "W_ih has shape {}, expected ({}, I): {} gates (r, z, n) of H rows each",
        shape_arg(W_ih.shape()), gates.rows, gates.count);
  const RnnDims d{x.dim(0), x.dim(1), x.dim(2), W_ih.dim(0) / gates.count};
  check(W_ih.dim(1) == d.I, op, "x {} and W_ih {} do not match, expected W_ih ({}, {})",
        shape_arg(x.shape()), shape_arg(W_ih.shape()), gates.rows, d.I);
  check(W_hh.dim(0) == gates.count * d.H && W_hh.dim(1) == d.H, op,
        "W_hh has shape {}, expected ({}, H) = ({}, {}) from W_ih {}", shape_arg(W_hh.shape()),
        gates.rows, gates.count * d.H, d.H, shape_arg(W_ih.shape()));
  if (h0.defined()) {
    detail::check_float_tensor(op, "h0", h0);
    detail::check_same_dtype(op, "h0", h0, "x", x);
    check(h0.shape() == Shape{d.B, d.H}, op, "h0 has shape {}, expected (B, H) = ({}, {})",
          shape_arg(h0.shape()), d.B, d.H);
  }
  return d;
}

// b_ih and b_hh: both undefined, or both (gates*H) with x's dtype.
void check_biases(const char* op, const Tensor& b_ih, const Tensor& b_hh, const Tensor& x,
                  const RnnDims& d, const Gates& gates = kRnnGates) {
  check(b_ih.defined() == b_hh.defined(), op,
        "b_ih is {} but b_hh is {}: give both biases or neither",
        b_ih.defined() ? "given" : "undefined", b_hh.defined() ? "given" : "undefined");
  for (const auto& [name, bias] : {std::pair{"b_ih", &b_ih}, std::pair{"b_hh", &b_hh}}) {
    if (!bias->defined()) continue;
    detail::check_float_tensor(op, name, *bias);
    detail::check_same_dtype(op, name, *bias, "x", x);
    check(bias->ndim() == 1 && bias->dim(0) == gates.count * d.H, op,
          "{} has shape {}, expected ({}) = ({})", name, shape_arg(bias->shape()), gates.rows,
          gates.count * d.H);
  }
}

// dout and output (B, n, H), dh_n (B, H) or undefined, with x's dtype.
void check_backward_inputs(const char* op, const Tensor& dout, const Tensor& dh_n,
                           const Tensor& output, const Tensor& x, const RnnDims& d) {
  const Shape out_shape{d.B, d.N, d.H};
  for (const auto& [name, t] : {std::pair{"dout", &dout}, std::pair{"output", &output}}) {
    detail::check_float_tensor(op, name, *t);
    detail::check_same_dtype(op, name, *t, "x", x);
    check(t->shape() == out_shape, op, "{} has shape {}, expected (B, n, H) = {}", name,
          shape_arg(t->shape()), shape_arg(out_shape));
  }
  if (dh_n.defined()) {
    detail::check_float_tensor(op, "dh_n", dh_n);
    detail::check_same_dtype(op, "dh_n", dh_n, "x", x);
    check(dh_n.shape() == Shape{d.B, d.H}, op, "dh_n has shape {}, expected (B, H) = ({}, {})",
          shape_arg(dh_n.shape()), d.B, d.H);
  }
}

// The final state: the last output; for n = 0 the initial state (zeros without h0), as PyTorch.
Tensor final_state(const Tensor& output, const Tensor& h0, const RnnDims& d) {
  if (d.N > 0) return output.select(1, d.N - 1).clone();
  return h0.defined() ? h0.contiguous().clone() : Tensor::zeros({d.B, d.H}, output.dtype());
}

template <typename F>
F* data_or_null(const Tensor& t) {
  return t.defined() ? t.data<F>() : nullptr;
}

Tensor contiguous_or_undefined(const Tensor& t) {
  return t.defined() ? t.contiguous() : Tensor();
}

}  // namespace

RnnResult rnn_tanh(Context& ctx, const Tensor& x, const Tensor& h0, const Tensor& W_ih,
                   const Tensor& W_hh, const Tensor& b_ih, const Tensor& b_hh) {
  constexpr const char* op = "rnn_tanh";
  const RnnDims d = check_rnn(op, x, h0, W_ih, W_hh);
  check_biases(op, b_ih, b_hh, x, d);
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
  r.h_n = final_state(r.output, hc, d);
  return r;
}

RnnGrads rnn_tanh_backward(Context& ctx, const Tensor& dout, const Tensor& dh_n, const Tensor& x,
                           const Tensor& h0, const Tensor& W_ih, const Tensor& W_hh,
                           const Tensor& output, bool has_bias) {
  constexpr const char* op = "rnn_tanh_backward";
  const RnnDims d = check_rnn(op, x, h0, W_ih, W_hh);
  check_backward_inputs(op, dout, dh_n, output, x, d);
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

GruResult gru(Context& ctx, const Tensor& x, const Tensor& h0, const Tensor& W_ih,
              const Tensor& W_hh, const Tensor& b_ih, const Tensor& b_hh) {
  constexpr const char* op = "gru";
  const RnnDims d = check_rnn(op, x, h0, W_ih, W_hh, kGruGates);
  check_biases(op, b_ih, b_hh, x, d, kGruGates);
  (void)ctx;
  const Tensor xc = x.contiguous(), wi = W_ih.contiguous(), wh = W_hh.contiguous();
  const Tensor hc = contiguous_or_undefined(h0), bi = contiguous_or_undefined(b_ih),
               bh = contiguous_or_undefined(b_hh);
  GruResult r;
  r.output = Tensor::empty({d.B, d.N, d.H}, x.dtype());
  const int64_t macs = detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    return ref::gru_forward<F>(xc.data<F>(), data_or_null<F>(hc), wi.data<F>(), wh.data<F>(),
                               data_or_null<F>(bi), data_or_null<F>(bh), r.output.data<F>(), d.B,
                               d.N, d.I, d.H);
  });
  r.flops = 2 * macs;
  r.h_n = final_state(r.output, hc, d);
  return r;
}

GruGrads gru_backward(Context& ctx, const Tensor& dout, const Tensor& dh_n, const Tensor& x,
                      const Tensor& h0, const Tensor& W_ih, const Tensor& W_hh, const Tensor& b_ih,
                      const Tensor& b_hh, const Tensor& output) {
  constexpr const char* op = "gru_backward";
  const RnnDims d = check_rnn(op, x, h0, W_ih, W_hh, kGruGates);
  check_biases(op, b_ih, b_hh, x, d, kGruGates);
  check_backward_inputs(op, dout, dh_n, output, x, d);
  (void)ctx;
  const Tensor dc = dout.contiguous(), xc = x.contiguous(), wi = W_ih.contiguous(),
               wh = W_hh.contiguous(), oc = output.contiguous();
  const Tensor hc = contiguous_or_undefined(h0), dhc = contiguous_or_undefined(dh_n),
               bi = contiguous_or_undefined(b_ih), bh = contiguous_or_undefined(b_hh);
  const bool has_bias = b_ih.defined();
  GruGrads g;
  g.dx = Tensor::empty(x.shape(), x.dtype());
  g.dh0 = Tensor::empty({d.B, d.H}, x.dtype());
  g.dW_ih = Tensor::empty(W_ih.shape(), x.dtype());
  g.dW_hh = Tensor::empty(W_hh.shape(), x.dtype());
  if (has_bias) {
    g.db_ih = Tensor::empty({3 * d.H}, x.dtype());
    g.db_hh = Tensor::empty({3 * d.H}, x.dtype());
  }
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::gru_backward<F>(dc.data<F>(), data_or_null<F>(dhc), xc.data<F>(), data_or_null<F>(hc),
                         wi.data<F>(), wh.data<F>(), data_or_null<F>(bi), data_or_null<F>(bh),
                         oc.data<F>(), g.dx.data<F>(), g.dh0.data<F>(), g.dW_ih.data<F>(),
                         g.dW_hh.data<F>(), data_or_null<F>(g.db_ih), data_or_null<F>(g.db_hh), d.B,
                         d.N, d.I, d.H);
  });
  return g;
}

}  // namespace attn
