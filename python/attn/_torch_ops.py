"""attn's kernels as PyTorch custom operators (torch.library.custom_op, PyTorch >= 2.4), so that
torch.compile traces a model using attn.torch without a graph break: Dynamo sees one opaque op
per kernel call, with a fake implementation giving the output's shape, dtype and strides, and an
autograd formula that calls the backward op. attn.torch (python/attn/torch.py) calls these on
PyTorch >= 2.4 and its torch.autograd.Functions on older versions (Debian's 1.13).

Vocabulary: B batch, T queries, S keys, H heads, D head width, Dv of v, E = H*D.

Ops (namespace attn), each forward with its backward:
  sdpa            q (B, T, D), k (B, S, D), v (B, S, Dv), any strides -> out (B, T, Dv),
                  logsumexp (B, T), rng_state (2,) int64 [seed, stream offset]
  heads_attention q (B, T, H*D), k (B, S, H*D), v (B, S, H*Dv), unit feature stride, read through
                  head strides -> out (B, T, H*Dv), logsumexp (B*H, T), rng_state
  packed_heads_attention  self-attention on one (B, T, 3E) in-projection; its gradient is one
                  tensor in qkv's layout
  linear          y = x W^T + b on attn's GEMM, float32 or bfloat16
  mask_lens       d2l's valid_lens from boolean or 0/-inf masks (validated at run time)

Arguments the ops cannot take as Python objects travel as plain values: the attn.Context as an
integer id (context_id), so that Dynamo treats it as a constant. The dropout stream offset a
forward takes is returned in rng_state, so the backward redraws the same mask (the fused
kernel's recorded decisions, when it recorded them, are kept in a small cache keyed by that
state and read instead: a pure speed-up, the redraw gives the same mask).
"""

import weakref
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

from . import _attn
from . import torch as _at

_contexts = weakref.WeakValueDictionary()  # id -> attn.Context


@torch.compiler.assume_constant_result
def context_id(actx):
    """An integer naming actx for the ops. Under torch.compile Dynamo runs this once while tracing
    and keeps the result as a constant (so it registers the Context for real, not as a deferred
    side effect the graph would run too late)."""
    cid = id(actx)
    if _contexts.get(cid) is not actx:
        _contexts[cid] = actx
    return cid


@torch.compiler.assume_constant_result
def fused_supported(dtype_name, cid):
    """Whether the fused head-strided kernels serve dtype_name on the Context's backend, as a
    constant of the trace."""
    return _attn._heads_supported(dtype_name, _contexts[cid])


def _context(cid):
    return _contexts[cid]


def _to_state(seed, offset):
    """[seed, offset] as int64 (the uint64 seed's bits)."""
    seed = seed - (1 << 64) if seed >= (1 << 63) else seed
    return torch.tensor([seed, offset], dtype=torch.int64)


def _from_state(state):
    seed, offset = (int(x) for x in state.tolist())
    return seed + (1 << 64) if seed < 0 else seed, offset


_KEEP_CACHE_SIZE = 32
_keep_cache = OrderedDict()  # (context id, seed, offset) -> the forward's dropout decisions


def _remember_keep(cid, seed, offset, keep):
    if keep is None:
        return
    _keep_cache[(cid, seed, offset)] = keep
    while len(_keep_cache) > _KEEP_CACHE_SIZE:
        _keep_cache.popitem(last=False)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- sdpa: (B, T, D) tensors, any strides --------------------------------------------------------

@torch.library.custom_op("attn::sdpa", mutates_args=())
def sdpa(q: Tensor, k: Tensor, v: Tensor, valid_lens: Optional[Tensor], lens_repeat: int,
         causal: bool, dropout_p: float, training: bool, scale: Optional[float],
         masked_rows: str, ctx_id: int) -> tuple[Tensor, Tensor, Tensor]:
    actx = _context(ctx_id)
    out, lse, seed, offset = _attn._sdpa_forward(q, k, v, valid_lens, lens_repeat, causal,
                                                 dropout_p, training, scale, masked_rows,
                                                 _at._threads(actx, q.dtype), actx)
    return out.contiguous(), lse.contiguous(), _to_state(seed, offset)


@sdpa.register_fake
def _(q, k, v, valid_lens, lens_repeat, causal, dropout_p, training, scale, masked_rows, ctx_id):
    B, T = q.shape[0], q.shape[1]
    return (q.new_empty((B, T, v.shape[2])), q.new_empty((B, T), dtype=_lse_dtype(q.dtype)),
            q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op("attn::sdpa_backward", mutates_args=())
def sdpa_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  rng_state: Tensor, valid_lens: Optional[Tensor], lens_repeat: int, causal: bool,
                  dropout_p: float, training: bool, scale: Optional[float], masked_rows: str,
                  ctx_id: int) -> tuple[Tensor, Tensor, Tensor]:
    actx = _context(ctx_id)
    seed, offset = _from_state(rng_state)
    dq, dk, dv = _attn._sdpa_backward(_at._unit_feature_stride(dout), q, k, v, out, lse,
                                      valid_lens, lens_repeat, causal, dropout_p, training, scale,
                                      masked_rows, seed, offset, _at._threads(actx, q.dtype), actx)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@sdpa_backward.register_fake
def _(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _sdpa_setup(ctx, inputs, output):
    q, k, v, lens, *rest = inputs
    out, lse, state = output
    ctx.save_for_backward(q, k, v, out, lse, state, lens)
    ctx.rest = rest


def _sdpa_grad(ctx, dout, _dlse, _dstate):
    q, k, v, out, lse, state, lens = ctx.saved_tensors
    dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse, state, lens, *ctx.rest)
    return (dq, dk, dv) + (None,) * 8


torch.library.register_autograd("attn::sdpa", _sdpa_grad, setup_context=_sdpa_setup)


# --- heads_attention: (B, T, H*D) tensors read through head strides ---------------------------

def _heads_forward(q, k, v, heads, valid_lens, causal, p, training, scale, masked_rows, ctx_id):
    actx = _context(ctx_id)
    out, lse, seed, offset, keep = _attn._heads_forward(q, k, v, heads, valid_lens, causal, p,
                                                        training, scale, masked_rows,
                                                        _at._threads(actx), actx)
    _remember_keep(ctx_id, seed, offset, keep)
    return out.contiguous(), lse.contiguous(), _to_state(seed, offset)


def _heads_backward(dout, q, k, v, out, lse, state, heads, valid_lens, causal, p, training, scale,
                    masked_rows, ctx_id, dq, dk, dv):
    actx = _context(ctx_id)
    seed, offset = _from_state(state)
    keep = _keep_cache.pop((ctx_id, seed, offset), None)
    _attn._heads_backward(_at._unit_feature_stride(dout), q, k, v, out, lse, heads, valid_lens,
                          causal, p, training, scale, masked_rows, seed, offset, dq, dk, dv,
                          _at._threads(actx), actx, keep)


def _unit(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _heads_fake(q, v, heads):
    B, T = q.shape[0], q.shape[1]
    return (q.new_empty((B, T, v.shape[2])),
            q.new_empty((B * heads, T), dtype=torch.float32), q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op("attn::heads_attention", mutates_args=())
def heads_attention(q: Tensor, k: Tensor, v: Tensor, heads: int, valid_lens: Optional[Tensor],
                    causal: bool, dropout_p: float, training: bool, scale: Optional[float],
                    masked_rows: str, ctx_id: int) -> tuple[Tensor, Tensor, Tensor]:
    return _heads_forward(_unit(q), _unit(k), _unit(v), heads, valid_lens, causal, dropout_p,
                          training, scale, masked_rows, ctx_id)


@heads_attention.register_fake
def _(q, k, v, heads, *args):
    return _heads_fake(q, v, heads)


@torch.library.custom_op("attn::heads_attention_backward", mutates_args=())
def heads_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, rng_state: Tensor, heads: int,
                             valid_lens: Optional[Tensor], causal: bool, dropout_p: float,
                             training: bool, scale: Optional[float], masked_rows: str,
                             ctx_id: int) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = _unit(q), _unit(k), _unit(v)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
    _heads_backward(dout, q, k, v, out, lse, rng_state, heads, valid_lens, causal, dropout_p,
                    training, scale, masked_rows, ctx_id, dq, dk, dv)
    return dq, dk, dv


@heads_attention_backward.register_fake
def _(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _heads_setup(ctx, inputs, output):
    q, k, v, heads, lens, *rest = inputs
    out, lse, state = output
    ctx.save_for_backward(q, k, v, out, lse, state, lens)
    ctx.heads, ctx.rest = heads, rest


def _heads_grad(ctx, dout, _dlse, _dstate):
    q, k, v, out, lse, state, lens = ctx.saved_tensors
    dq, dk, dv = heads_attention_backward(dout, q, k, v, out, lse, state, ctx.heads, lens,
                                          *ctx.rest)
    return (dq, dk, dv) + (None,) * 8


torch.library.register_autograd("attn::heads_attention", _heads_grad, setup_context=_heads_setup)


# --- packed_heads_attention: self-attention on one (B, T, 3E) projection ------------------------

def _thirds(t):
    E = t.shape[-1] // 3
    return t[..., :E], t[..., E:2 * E], t[..., 2 * E:]


@torch.library.custom_op("attn::packed_heads_attention", mutates_args=())
def packed_heads_attention(qkv: Tensor, heads: int, valid_lens: Optional[Tensor], causal: bool,
                           dropout_p: float, training: bool, scale: Optional[float],
                           masked_rows: str, ctx_id: int) -> tuple[Tensor, Tensor, Tensor]:
    return _heads_forward(*_thirds(_unit(qkv)), heads, valid_lens, causal, dropout_p, training,
                          scale, masked_rows, ctx_id)


@packed_heads_attention.register_fake
def _(qkv, heads, *args):
    q, _, v = _thirds(qkv)
    return _heads_fake(q, v, heads)


@torch.library.custom_op("attn::packed_heads_attention_backward", mutates_args=())
def packed_heads_attention_backward(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor,
                                    rng_state: Tensor, heads: int, valid_lens: Optional[Tensor],
                                    causal: bool, dropout_p: float, training: bool,
                                    scale: Optional[float], masked_rows: str,
                                    ctx_id: int) -> Tensor:
    qkv = _unit(qkv)
    dqkv = torch.empty_like(qkv)  # keeps qkv's strides (a dense permuted view stays one)
    _heads_backward(dout, *_thirds(qkv), out, lse, rng_state, heads, valid_lens, causal, dropout_p,
                    training, scale, masked_rows, ctx_id, *_thirds(dqkv))
    return dqkv


@packed_heads_attention_backward.register_fake
def _(dout, qkv, *args):
    return torch.empty_like(qkv)


def _packed_setup(ctx, inputs, output):
    qkv, heads, lens, *rest = inputs
    out, lse, state = output
    ctx.save_for_backward(qkv, out, lse, state, lens)
    ctx.heads, ctx.rest = heads, rest


def _packed_grad(ctx, dout, _dlse, _dstate):
    qkv, out, lse, state, lens = ctx.saved_tensors
    return (packed_heads_attention_backward(dout, qkv, out, lse, state, ctx.heads, lens,
                                            *ctx.rest),) + (None,) * 8


torch.library.register_autograd("attn::packed_heads_attention", _packed_grad,
                                setup_context=_packed_setup)


# --- linear: y = x W^T + b on attn's GEMM -------------------------------------------------------

@torch.library.custom_op("attn::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], ctx_id: int) -> Tensor:
    x2, w2 = _at._rows(x), _at._rows(weight)
    y = torch.empty(x.shape[:-1] + (weight.shape[0],), dtype=x.dtype)
    _attn._linear_forward(x2, w2, bias, y.view(-1, weight.shape[0]),
                          _at._threads(_context(ctx_id)))
    return y


@linear.register_fake
def _(x, weight, bias, ctx_id):
    return x.new_empty(x.shape[:-1] + (weight.shape[0],))


@torch.library.custom_op("attn::linear_backward", mutates_args=())
def linear_backward(dy: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool,
                    need_b: bool, ctx_id: int) -> tuple[Tensor, Tensor, Tensor]:
    x2, w2 = _at._rows(x), _at._rows(weight)
    dx = torch.empty(x.shape, dtype=x.dtype) if need_x else x.new_empty((0,))
    dw = torch.empty(weight.shape, dtype=weight.dtype) if need_w else x.new_empty((0,))
    db = torch.empty(weight.shape[0], dtype=weight.dtype) if need_b else x.new_empty((0,))
    if need_x or need_w or need_b:
        _attn._linear_backward(_at._rows(dy), x2, w2, dx.view(x2.shape) if need_x else None,
                               dw if need_w else None, db if need_b else None,
                               _at._threads(_context(ctx_id)))
    return dx, dw, db


@linear_backward.register_fake
def _(dy, x, weight, need_x, need_w, need_b, ctx_id):
    return (x.new_empty(x.shape if need_x else (0,)),
            weight.new_empty(weight.shape if need_w else (0,)),
            weight.new_empty((weight.shape[0],) if need_b else (0,)))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, ctx_id = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias, ctx.ctx_id = bias is not None, ctx_id


def _linear_grad(ctx, dy):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and ctx.has_bias
    dx, dw, db = linear_backward(dy, x, weight, need_x, need_w, need_b, ctx.ctx_id)
    return dx if need_x else None, dw if need_w else None, db if need_b else None, None


torch.library.register_autograd("attn::linear", _linear_grad, setup_context=_linear_setup)


# --- mask_lens: masks to d2l's valid_lens, checked where the data is ----------------------------

@torch.library.custom_op("attn::mask_lens", mutates_args=())
def mask_lens(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], batch: int,
              queries: int, keys: int, heads: int, is_causal: bool, op: str) -> Tensor:
    return _at._mask_lens(key_padding_mask, attn_mask, batch, queries, keys, heads, is_causal, op)


@mask_lens.register_fake
def _(key_padding_mask, attn_mask, batch, queries, keys, heads, is_causal, op):
    per_query = attn_mask is not None and not is_causal
    return torch.empty((batch, queries) if per_query else (batch,), dtype=torch.int64)
