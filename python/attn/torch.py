"""attn inside PyTorch: attn's fused attention kernels in PyTorch's autograd, as a function
with F.scaled_dot_product_attention's arguments and as a drop-in replacement for
torch.nn.MultiheadAttention, on CPU tensors; PyTorch 2.x (custom operators, torch.compile) and
Debian's 1.13 (torch.autograd.Function).

    import torch, attn.torch
    out = attn.torch.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.1,
                                                  is_causal=False, valid_lens=lens)
    mha = attn.torch.MultiheadAttention(256, 8, dropout=0.1, batch_first=True)
    y, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
    model = torch.compile(model)          # PyTorch >= 2.4: no graph break at attn's calls

On PyTorch >= 2.4 every kernel call is a custom operator (python/attn/_torch_ops.py: attn::sdpa,
attn::heads_attention, attn::packed_heads_attention, attn::linear, attn::mask_lens, each with a
fake implementation and an autograd formula), so torch.compile traces through them; before 2.4
the same kernels run as the torch.autograd.Functions below.

Vocabulary: B batch, T queries, S keys, H heads, D head width (of q and k), Dv of v, E = H*D.

Tensors cross into C++ without copies: float32/float64 through NumPy (tensor.numpy() shares the
memory), bfloat16 as its int16 bits (NumPy has no bfloat16); results come back as torch tensors
over attn's buffers (torch.from_numpy), and the C++ runs with the GIL released. attn's kernels
run with the Context's thread count when it is set (> 0), else torch.get_num_threads(), plus
one spare thread for the fused kernels when that is 2 or more (see _threads).

Which kernel runs:
  - float32 and bfloat16 on the default backend: attn's fused (flash) kernels, forward and
    backward; the backward recomputes the weights from the saved output and logsumexp, so no
    (B, H, T, S) tensor is ever stored. MultiheadAttention and 4-D inputs whose heads sit in the
    feature axis (x.view(B, T, H, D).transpose(1, 2), the usual head split) read q, k, v through
    head strides: no transpose copies. MultiheadAttention's in- and out-projections run there
    on attn's GEMM too (oneDNN, _Linear), so the whole module, forward and backward, runs on the
    one OpenMP pool that attn's kernels use, with no switch to OpenBLAS's threads in between.
  - float64, or a Context with backend='reference': attn's reference loops (double
    accumulation), forward and backward; MultiheadAttention's projections are torch's F.linear.
    torch.autograd.gradcheck runs on this path.

Masks follow d2l: valid_lens None, (B,) or (B, T), integer or float; key s of row (b, t) is kept
iff s < valid_lens. causal=True also masks keys s > t. A row with no kept key is uniform over all
keys (masked_rows='uniform', d2l) or zero (masked_rows='zero', PyTorch SDPA's policy). Dropout
is attn's inverted dropout drawn from the Philox stream of the Context (attn.default_context, or
the module's own): the backward reads the forward's mask (the decisions the fused kernel recorded,
1 bit per weight, on AVX-512 and bf16 CPUs) or redraws it. It acts only when training and
dropout_p > 0; the masks differ from torch's dropout (another generator), so a swapped-in module
trains to the same loss curve only statistically when dropout is on.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from . import _attn

__all__ = ["scaled_dot_product_attention", "reference_attention", "MultiheadAttention"]

_OPS = None  # python/attn/_torch_ops.py on PyTorch >= 2.4 (set at the end of this file)


def _torch_version():
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def _compiling():
    """Whether torch.compile (Dynamo) is tracing this call."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


def _autocast_cpu():
    if _torch_version() >= (2, 4):
        return torch.is_autocast_enabled("cpu")
    return torch.is_autocast_cpu_enabled()


def _ctx_id(actx):
    """The integer the custom operators take for actx (None before PyTorch 2.4)."""
    return None if _OPS is None else _OPS.context_id(actx)


def _threads(actx, dtype=torch.float32):
    """The Context's thread count when set (> 0). Else torch's (torch.set_num_threads), plus one
    spare thread when that is 2 or more and the fused kernels run (float32 or bfloat16 on the
    default backend). Why the spare: in a PyTorch loop, OpenBLAS (Debian torch's BLAS) keeps a
    worker spinning on one core for ~0.1 s after every GEMM torch runs, so attn's threads share
    that core with it; the fused kernels and the projections (gemm_panels) hand out their work
    on a dynamic schedule, and one more thread than cores takes the cycles the spinner leaves
    (d2l's loop, 2 cores, bench/torch_swap.py --attn-threads: 1.47-1.56x nn.MultiheadAttention's
    step with 2 threads, 1.61-1.64x with 3). With nothing else running
    (bench/torch_module_threads.py) the float32 module is no slower with 3, bfloat16 ~8% slower
    (its forward packs K and V on a static schedule). Set Context.threads to choose. Results do
    not depend on the thread count. The reference loops (float64, backend='reference') keep
    torch's count."""
    t = actx.threads
    if t > 0:
        return t
    n = torch.get_num_threads()
    fused = dtype in (torch.float32, torch.bfloat16) and actx.backend != "reference"
    return n + 1 if n > 1 and fused else n


_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _check_tensors(op, *tensors):
    for x in tensors:
        if not torch.is_tensor(x):
            raise TypeError(f"{op}: expected torch tensors, got {type(x).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"{op}: a tensor is on {x.device}; attn.torch runs attn's CPU "
                             "kernels (move it with .cpu())")
        if x.dtype not in _DTYPES:
            raise ValueError(f"{op}: a tensor has dtype {x.dtype}, expected torch.float32, "
                             "torch.float64 or torch.bfloat16")


def _unit_feature_stride(t):
    """t itself if its last axis has stride 1 and no axis of length > 1 has stride 0; else a
    contiguous copy (gradients from .sum() or .expand() arrive with zero strides)."""
    if t.stride(-1) == 1 and all(s != 0 or n == 1 for s, n in zip(t.stride(), t.shape)):
        return t
    return t.contiguous()


def _lens_tensor(valid_lens):
    if valid_lens is None:
        return None
    if not torch.is_tensor(valid_lens):
        valid_lens = torch.as_tensor(valid_lens)
    return valid_lens.detach().cpu()


class _Attention(torch.autograd.Function):
    """(B, T, D) q, k, v of one dtype, any strides: attn::scaled_dot_product_attention and its
    backward (fused for float32/bfloat16, reference loops for float64)."""

    @staticmethod
    def forward(fctx, q, k, v, valid_lens, lens_repeat, causal, p, training, scale, masked_rows,
                actx):
        out, lse, seed, offset = _attn._sdpa_forward(q, k, v, valid_lens, lens_repeat, causal, p,
                                                     training, scale, masked_rows,
                                                     _threads(actx, q.dtype), actx)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.args = (valid_lens, lens_repeat, causal, p, training, scale, masked_rows, seed,
                     offset, actx)
        fctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable  # attn has no backward of its backward
    def backward(fctx, dout, _dlse):
        q, k, v, out, lse = fctx.saved_tensors
        lens, repeat, causal, p, training, scale, masked_rows, seed, offset, actx = fctx.args
        dq, dk, dv = _attn._sdpa_backward(_unit_feature_stride(dout), q, k, v, out, lse, lens,
                                          repeat, causal, p, training, scale, masked_rows, seed,
                                          offset, _threads(actx, q.dtype), actx)
        return (dq, dk, dv) + (None,) * 8


def _heads_call(fctx, q, k, v, heads, valid_lens, causal, p, training, scale, masked_rows, actx):
    out, lse, seed, offset, keep = _attn._heads_forward(q, k, v, heads, valid_lens, causal, p,
                                                        training, scale, masked_rows,
                                                        _threads(actx), actx)
    fctx.args = (heads, valid_lens, causal, p, training, scale, masked_rows, seed, offset, actx)
    fctx.dropout_keep = keep  # the kernel's dropout decisions (or None): no redraw backward
    fctx.mark_non_differentiable(lse)
    return out, lse


def _heads_grads(fctx, dout, q, k, v, out, lse, dq, dk, dv):
    heads, lens, causal, p, training, scale, masked_rows, seed, offset, actx = fctx.args
    _attn._heads_backward(_unit_feature_stride(dout), q, k, v, out, lse, heads, lens, causal, p,
                          training, scale, masked_rows, seed, offset, dq, dk, dv,
                          _threads(actx), actx, fctx.dropout_keep)


class _HeadsAttention(torch.autograd.Function):
    """(B, T, H*D) q, k, v with unit feature stride (head h owns features [h*D, (h+1)*D)), float32
    or bfloat16: the fused kernels through head strides. Output (B, T, H*Dv) contiguous."""

    @staticmethod
    def forward(fctx, q, k, v, heads, valid_lens, causal, p, training, scale, masked_rows, actx):
        out, lse = _heads_call(fctx, q, k, v, heads, valid_lens, causal, p, training, scale,
                               masked_rows, actx)
        fctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    @once_differentiable  # attn has no backward of its backward
    def backward(fctx, dout, _dlse):
        q, k, v, out, lse = fctx.saved_tensors
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
        _heads_grads(fctx, dout, q, k, v, out, lse, dq, dk, dv)
        return (dq, dk, dv) + (None,) * 8


class _PackedHeadsAttention(torch.autograd.Function):
    """Self-attention on one (B, T, 3E) in-projection (q, k, v its column thirds, any row strides,
    unit feature stride): the gradient is one (B, T, 3E) tensor in the projection's own layout,
    written by the fused backward in place (no torch.cat of three gradients)."""

    @staticmethod
    def forward(fctx, qkv, heads, valid_lens, causal, p, training, scale, masked_rows, actx):
        E = qkv.shape[-1] // 3
        q, k, v = qkv[..., :E], qkv[..., E:2 * E], qkv[..., 2 * E:]
        out, lse = _heads_call(fctx, q, k, v, heads, valid_lens, causal, p, training, scale,
                               masked_rows, actx)
        fctx.save_for_backward(qkv, out, lse)
        return out, lse

    @staticmethod
    @once_differentiable  # attn has no backward of its backward
    def backward(fctx, dout, _dlse):
        qkv, out, lse = fctx.saved_tensors
        E = qkv.shape[-1] // 3
        dqkv = torch.empty_like(qkv)  # keeps qkv's strides (a dense permuted view stays one)
        thirds = lambda t: (t[..., :E], t[..., E:2 * E], t[..., 2 * E:])  # noqa: E731
        _heads_grads(fctx, dout, *thirds(qkv), out, lse, *thirds(dqkv))
        return (dqkv,) + (None,) * 8


def _rows(t):
    """t (..., n) as the (rows, n) matrix attn's GEMM reads (unit column stride, non-overlapping
    rows): a view where the leading axes merge (contiguous tensors, column slices, the rows of a
    (T, B, E) tensor), else a contiguous copy (e.g. gradients with zero strides from .expand())."""
    n = t.shape[-1]
    m = t.reshape(-1, n)
    if (m.stride(1) == 1 or n <= 1) and (m.stride(0) >= n or m.shape[0] <= 1):
        return m
    return m.contiguous()


class _Linear(torch.autograd.Function):
    """y = x W^T + b on attn's GEMM (oneDNN on OpenMP, the pool attn's attention kernels run on),
    float32 or bfloat16: MultiheadAttention's projections on its fused path. x (..., K) any
    layout whose leading axes merge into rows (else copied once), W (N, K) with unit column stride
    (slices of in_proj_weight included), b (N) or None; y (..., N) contiguous. The backward writes
    dx, dW, db into fresh tensors (only those needs_input_grad asks for) and autograd accumulates
    them into .grad as it does torch's."""

    @staticmethod
    def forward(fctx, x, weight, bias, threads):
        x2, w2 = _rows(x), _rows(weight)
        y = torch.empty(x.shape[:-1] + (weight.shape[0],), dtype=x.dtype)
        _attn._linear_forward(x2, w2, bias, y.view(-1, weight.shape[0]), threads)
        fctx.save_for_backward(x2, w2)
        fctx.x_shape, fctx.threads = x.shape, threads
        return y

    @staticmethod
    @once_differentiable  # as the core: no backward of the backward
    def backward(fctx, dy):
        x2, w2 = fctx.saved_tensors
        need_x, need_w, need_b, _ = fctx.needs_input_grad
        dx = torch.empty(fctx.x_shape, dtype=x2.dtype) if need_x else None
        dw = torch.empty(w2.shape, dtype=w2.dtype) if need_w else None
        db = torch.empty(w2.shape[0], dtype=w2.dtype) if need_b else None
        if need_x or need_w or need_b:
            _attn._linear_backward(_rows(dy), x2, w2, None if dx is None else dx.view(x2.shape),
                                   dw, db, fctx.threads)
        return dx, dw, db, None


def _core(q, k, v, lens, lens_repeat, causal, p, training, scale, masked_rows, actx):
    """(B, T, D) attention, any strides: attn::sdpa on PyTorch >= 2.4, else _Attention."""
    if _OPS is not None:
        return _OPS.sdpa(q, k, v, lens, lens_repeat, causal, p, training, scale, masked_rows,
                         _OPS.context_id(actx))[0]
    return _Attention.apply(q, k, v, lens, lens_repeat, causal, p, training, scale, masked_rows,
                            actx)[0]


def _heads(q, k, v, heads, lens, causal, p, training, scale, masked_rows, actx):
    """(B, T, H*D) attention through head strides: attn::heads_attention or _HeadsAttention."""
    if _OPS is not None:
        return _OPS.heads_attention(q, k, v, heads, lens, causal, p, training, scale, masked_rows,
                                    _OPS.context_id(actx))[0]
    return _HeadsAttention.apply(q, k, v, heads, lens, causal, p, training, scale, masked_rows,
                                 actx)[0]


def _packed(qkv, heads, lens, causal, p, training, scale, masked_rows, actx):
    """Self-attention on one (B, T, 3E) projection: attn::packed_heads_attention or
    _PackedHeadsAttention."""
    if _OPS is not None:
        return _OPS.packed_heads_attention(qkv, heads, lens, causal, p, training, scale,
                                           masked_rows, _OPS.context_id(actx))[0]
    return _PackedHeadsAttention.apply(qkv, heads, lens, causal, p, training, scale, masked_rows,
                                       actx)[0]


def _attn_linear(x, weight, bias, actx):
    """x W^T + b on attn's GEMM: attn::linear or _Linear."""
    if _OPS is not None:
        return _OPS.linear(x, weight, bias, _OPS.context_id(actx))
    return _Linear.apply(x, weight, bias, _threads(actx))


def _attn_linear_ok(actx, x, weight, bias):
    """Whether _Linear serves this projection: float32 or bfloat16 of one dtype, non-empty, on a
    context whose backend runs the fused kernels (float64 and backend='reference' keep F.linear,
    where gradcheck runs), outside torch.autocast (whose F.linear casts to its dtype; a custom
    Function would not)."""
    return not _autocast_cpu() and \
        x.dtype in (torch.float32, torch.bfloat16) and x.dtype == weight.dtype and \
        (bias is None or bias.dtype == x.dtype) and x.numel() > 0 and weight.numel() > 0 and \
        _fused_supported(_dtype_name_of(x.dtype), actx)


def _fused_heads_ok(dtype, actx, *tensors):
    """Whether the head-strided fused kernels take these tensors (empty ones go the (B*H) way,
    whose op handles every empty shape)."""
    return dtype in (torch.float32, torch.bfloat16) and all(t.numel() > 0 for t in tensors) and \
        _fused_supported(_dtype_name_of(dtype), actx)


def _fused_supported(dtype_name, actx):
    """_attn._heads_supported; under torch.compile a constant of the trace (through the
    Context's id), so that Dynamo need not look into the binding."""
    if _OPS is not None:
        return _OPS.fused_supported(dtype_name, _OPS.context_id(actx))
    return _attn._heads_supported(dtype_name, actx)


def _dtype_name_of(dtype):
    return str(dtype).replace("torch.", "")


def _as_heads_view(x):
    """(B, H, L, D) -> the (B, L, H*D) tensor it is a head split of, as a view, or None when the
    heads do not sit side by side in one feature axis."""
    B, H, L, D = x.shape
    y = x.transpose(1, 2)  # (B, L, H, D)
    if (y.stride(3) == 1 or D == 1) and (y.stride(2) == D or H == 1):
        return y.reshape(B, L, H * D)  # a view: the two axes merge
    return None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 valid_lens=None, training=True, masked_rows="uniform", ctx=None):
    """torch.nn.functional.scaled_dot_product_attention's call on attn's kernels:
    out = dropout(softmax(query key^T * scale + mask)) value, differentiable in query, key and
    value.

    query (B, T, D) or (B, H, T, D), key (B, [H,] S, D), value (B, [H,] S, Dv): float32, float64
    or bfloat16 CPU tensors of one dtype, any strides. Returns (B, [H,] T, Dv) in their dtype.
      attn_mask: None, or a mask that broadcasts to (B, [H,] T, S), boolean (True: the key takes
        part, as F.scaled_dot_product_attention) or float holding 0 (keep) and -inf (masked). The
        kept keys of each row must be a prefix 0..len-1 (right padding, the causal mask, or both:
        what d2l's valid_lens describe) and the same for every head; anything else (left padding,
        windows, additive biases) is a ValueError naming it.
      is_causal: query t sees keys 0..t (with attn_mask, both apply).
      scale: default 1/sqrt(D). dropout_p: attn's inverted dropout, when training (attn's Philox
        stream of ctx, attn.default_context by default; not torch's generator).
      enable_gqa: accepted; grouped-query attention (fewer key/value heads) is a ValueError.
      valid_lens (keyword): d2l's None, (B,) or (B, T), per batch row (every head of row b uses
        valid_lens[b], as d2l's MultiHeadAttention repeats them); with attn_mask, both apply.
      masked_rows: a row with no kept key is uniform over all keys ('uniform', d2l) or zero
        ('zero'); torch's SDPA gives NaN there.
    """
    op = "attn.torch.scaled_dot_product_attention"
    _check_tensors(op, query, key, value)
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"{op}: query, key, value have dtypes {query.dtype}, {key.dtype}, "
                         f"{value.dtype}, expected one dtype for all (convert them with .to())")
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(f"{op}: {shapes}: expected all (B, T, D) or all (B, H, T, D)")
    B, T, S = query.shape[0], query.shape[-2], key.shape[-2]
    H = query.shape[1] if query.dim() == 4 else 1
    if query.dim() == 4 and (key.shape[:2] != (B, H) or value.shape[:2] != (B, H)):
        if enable_gqa and key.shape[0] == B and key.shape[1] != H:
            raise ValueError(f"{op}: {shapes}: grouped-query attention (enable_gqa, {key.shape[1]} "
                             f"key/value heads for {H} query heads) is not supported; repeat key "
                             "and value along the head axis (repeat_interleave(H // Hkv, dim=1))")
        raise ValueError(f"{op}: {shapes}: expected the same (B, H) leading axes")
    actx = ctx if ctx is not None else _attn.default_context
    lens = _lens_tensor(valid_lens)
    if attn_mask is not None:
        mask = attn_mask if query.dim() == 4 else attn_mask.unsqueeze(-3)
        mask_lens = _mask_lens_op()(None, mask, B, T, S, H, False, op)  # (B, T)
        if lens is None:
            lens = mask_lens
        else:  # both: the stricter per row
            lens = lens.to(torch.float64)
            lens = lens[:, None].expand(B, T) if lens.dim() == 1 else lens
            lens = torch.minimum(lens, mask_lens.to(torch.float64))
    p = float(dropout_p)
    scale = None if scale is None else float(scale)
    causal = bool(is_causal)
    if query.dim() == 3:
        return _core(query, key, value, lens, 1, causal, p, bool(training), scale, masked_rows,
                     actx)
    Dv = value.shape[-1]
    if _fused_heads_ok(query.dtype, actx, query, key, value):
        views = [_as_heads_view(x) for x in (query, key, value)]
        if all(x is not None for x in views):
            out = _heads(*views, H, lens, causal, p, bool(training), scale, masked_rows, actx)
            return out.view(B, T, H, Dv).transpose(1, 2)
    # Heads as batch rows b*H + h (d2l's split), copies only where the layout needs them.
    flat = [x.reshape(B * H, x.shape[2], x.shape[3]) for x in (query, key, value)]
    out = _core(*flat, lens, H, causal, p, bool(training), scale, masked_rows, actx)
    return out.view(B, H, T, Dv)


def _mask_lens_op():
    """attn::mask_lens on PyTorch >= 2.4 (checked at run time, also under torch.compile), else
    _mask_lens itself."""
    return _mask_lens if _OPS is None else _OPS.mask_lens


def _keep_of(mask, what, op, true_keeps):
    """A boolean keep-mask from a boolean mask (True keeps when true_keeps) or a float 0/-inf
    one."""
    if mask.dtype == torch.bool:
        return mask if true_keeps else ~mask
    if mask.is_floating_point():
        masked = torch.isneginf(mask)
        if not bool(((mask == 0) | masked).all()):
            raise ValueError(f"{op}: a float {what} must hold only 0 (keep) and -inf (masked); "
                             "attn's kernels take no additive bias (torch's own "
                             "F.scaled_dot_product_attention does)")
        return ~masked
    hint = " (d2l's valid_lens go in valid_lens=)" if what == "attn_mask" else ""
    raise ValueError(f"{op}: {what} has dtype {mask.dtype}, expected torch.bool or a float "
                     f"0/-inf mask{hint}")


def _mask_lens(key_padding_mask, attn_mask, B, T, S, H, is_causal, op):
    """d2l's valid_lens from masks: key_padding_mask (B, S), True or -inf marking a padded key
    (nn.MultiheadAttention's convention); attn_mask broadcasting to (B, H, T, S), True or 0
    keeping a key (F.scaled_dot_product_attention's). With is_causal the attn_mask (if any) must
    be the causal mask, and the lens come from the padding alone: (B,). Else with attn_mask the
    lens are per query, (B, T); with neither, S for every row. ValueError where the kept keys of
    a row are not a prefix 0..len-1, or differ between heads."""
    arange = torch.arange(S)
    pad_keep = None
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (B, S):
            raise ValueError(f"{op}: key_padding_mask has shape {tuple(key_padding_mask.shape)}, "
                             f"expected (batch, source length) = ({B}, {S})")
        pad_keep = _keep_of(key_padding_mask.detach().cpu(), "key_padding_mask", op, False)
        if not torch.equal(pad_keep, arange[None, :] < pad_keep.sum(-1)[:, None]):
            raise ValueError(f"{op}: key_padding_mask must pad a suffix of each row (keys "
                             "len..S-1, right padding, as d2l's valid_lens); this mask keeps a "
                             "key after a padded one")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            _keep_of(attn_mask, "attn_mask", op, True)  # raises, naming valid_lens=
        try:
            mask = attn_mask.detach().cpu().expand(B, H, T, S)
        except RuntimeError:
            raise ValueError(f"{op}: attn_mask has shape {tuple(attn_mask.shape)}, expected one "
                             f"that broadcasts to (B, H, T, S) = ({B}, {H}, {T}, {S})") from None
        keep = _keep_of(mask, "attn_mask", op, True)
        causal = torch.ones((T, S), dtype=torch.bool).tril()
        if is_causal:
            if not torch.equal(keep, causal.expand(B, H, T, S)):
                raise ValueError(f"{op}: is_causal=True with an attn_mask that is not the causal "
                                 "mask (keys 0..t for query t)")
        else:
            if H > 1 and not torch.equal(keep, keep[:, :1].expand(B, H, T, S)):
                raise ValueError(f"{op}: attn_mask differs between heads; attn's kernels take "
                                 "one mask per batch row")
            keep = keep[:, 0]
            if pad_keep is not None:
                keep = keep & pad_keep[:, None, :]
            lens = keep.sum(-1)
            if not torch.equal(keep, arange < lens[..., None]):
                raise ValueError(f"{op}: the mask keeps a key after a masked one in some row; "
                                 "attn's kernels take masks whose kept keys are a prefix 0..len-1 "
                                 "of each row (right padding, the causal mask, or both)")
            return lens
    if pad_keep is None:
        return torch.full((B,), S, dtype=torch.int64)
    return pad_keep.sum(-1)


def _keep_mask(T, S, valid_lens, causal, batch_shape, device):
    """Boolean (B, [H,] T, S): key s of row t kept (valid_lens per batch row, causal)."""
    keep = torch.ones((T, S), dtype=torch.bool, device=device)
    if causal:
        keep = keep.tril()
    B = batch_shape[0]
    keep = keep.expand(B, T, S)
    if valid_lens is not None:
        lens = valid_lens.to(device=device, dtype=torch.float64)
        lens = lens[:, None].expand(B, T) if lens.dim() == 1 else lens
        keep = keep & (torch.arange(S, device=device, dtype=torch.float64) < lens[..., None])
    if len(batch_shape) == 2:
        keep = keep[:, None]
    return keep


def reference_attention(query, key, value, valid_lens=None, causal=False, scale=None,
                        masked_rows="uniform", need_weights=False):
    """The same attention written with torch ops (no dropout): the oracle of the tests and the
    path of MultiheadAttention's weights. Shapes as scaled_dot_product_attention. Returns out, or
    (out, weights (B, [H,] T, S)) with need_weights."""
    D, T, S = query.shape[-1], query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    keep = _keep_mask(T, S, _lens_tensor(valid_lens), causal, query.shape[:-2], query.device)
    any_kept = keep.any(-1, keepdim=True)
    scores = scores.masked_fill(~keep, float("-inf")).masked_fill(~any_kept, 0.0)
    weights = torch.softmax(scores, dim=-1)
    if masked_rows == "zero":
        weights = weights.masked_fill(~any_kept, 0.0)
    elif masked_rows != "uniform":
        raise ValueError(f"masked_rows is {masked_rows!r}, expected 'uniform' or 'zero'")
    out = torch.matmul(weights, value)
    return (out, weights) if need_weights else out


def _mha_attn_mask(mask, B, H, T, S, op):
    """nn.MultiheadAttention's attn_mask ((T, S), or (B*H, T, S); bool True = not allowed, or
    float 0/-inf) as F.scaled_dot_product_attention's convention, broadcasting to (B, H, T, S)."""
    if mask.dim() == 2 and tuple(mask.shape) == (T, S):
        pass
    elif mask.dim() == 3 and tuple(mask.shape) == (B * H, T, S):
        mask = mask.reshape(B, H, T, S)
    else:
        raise ValueError(f"{op}: attn_mask has shape {tuple(mask.shape)}, expected (L, S) = "
                         f"({T}, {S}) or (batch * num_heads, L, S) = ({B * H}, {T}, {S})")
    return ~mask if mask.dtype == torch.bool else mask


def _is_causal_mask(mask, T, S, op):
    """Whether an SDPA-convention mask (bool True = keep, or float 0/-inf) is the causal mask
    (keys 0..t for query t), on every head and batch row it covers."""
    keep = _keep_of(mask.detach().cpu(), "attn_mask", op, True)
    return torch.equal(keep, torch.ones((T, S), dtype=torch.bool).tril().expand(keep.shape))


def _split_heads(x, H):
    """(B, L, H*D) -> (B, H, L, D), a view where the layout allows."""
    B, L, E = x.shape
    return x.reshape(B, L, H, E // H).transpose(1, 2)


class MultiheadAttention(nn.MultiheadAttention):
    """torch.nn.MultiheadAttention whose attention core runs attn's fused kernels.

    A subclass: same constructor, parameters (in_proj_weight, in_proj_bias, out_proj.weight,
    out_proj.bias; q/k/v_proj_weight when kdim or vdim differ from embed_dim), initialisation
    (same torch random draws) and state dict, so weights load both ways. The core is
    attn's attention op (a custom operator on PyTorch >= 2.4, so torch.compile traces the module
    without a graph break; an autograd Function before); the projections run on attn's GEMM
    (attn::linear or _Linear: oneDNN, autograd accumulating .grad as for torch's ops) where the
    fused kernels run (float32, bfloat16 on the default backend, outside torch.autocast),
    torch's F.linear otherwise (float64, backend='reference', autocast).
    Self-attention (query is key is value) projects once into one (B, T, 3E) tensor whose thirds
    the kernels read through head strides, and gets its gradient back in the same layout.

    Extra keyword arguments: masked_rows ('zero' by default: a query whose keys are all padded
    gets a zero output, where torch 1.13 gives NaN; 'uniform' is d2l's policy) and ctx (the
    attn.Context of the dropout stream; by default one seeded with torch.initial_seed()).

    forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) as torch's, with these limits (a ValueError says
    which):
      - key_padding_mask: bool (True = pad) or float 0/-inf, padding a suffix of each row (right
        padding: d2l's valid_lens);
      - attn_mask (L, S) or (batch * num_heads, L, S), bool (True = not allowed) or float 0/-inf:
        the kept keys of each query must be a prefix 0..len-1 (the causal mask; per-query
        lengths), the same for every head; no additive biases. The causal mask (also as
        is_causal=True, a hint that attn_mask is causal, as torch's) runs the kernels' causal
        mode; under torch.compile pass is_causal=True with it, since the mask's values are not
        known while tracing (they are checked at run time);
      - add_bias_kv and add_zero_attn are not supported.
    need_weights=True (torch's default) still computes the output with the fused kernels, and
    the weights (B, [T], S) with torch ops from the same projections (differentiable, averaged
    over heads unless average_attn_weights=False). They are the pre-dropout weights, as d2l
    returns them; torch 1.13 returns them after dropout (the same in eval mode). Pass
    need_weights=False for the fast path.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None, *, masked_rows="zero", ctx=None):
        if add_bias_kv or add_zero_attn:
            raise ValueError("attn.torch.MultiheadAttention: add_bias_kv and add_zero_attn are "
                             "not supported (attn's kernels take no extra key)")
        if masked_rows not in ("uniform", "zero"):
            raise ValueError(f"attn.torch.MultiheadAttention: masked_rows is {masked_rows!r}, "
                             "expected 'zero' or 'uniform'")
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
                         batch_first=batch_first, device=device, dtype=dtype)
        self.masked_rows = masked_rows
        self.context = ctx if ctx is not None else _attn.Context(seed=torch.initial_seed())

    # copy.deepcopy and pickle: the attn.Context travels as its settings (offset included).
    def __getstate__(self):
        state = self.__dict__.copy()
        c = state.pop("context")
        state["_context_settings"] = (c.seed, c.threads, c.backend, c.dropout_offset)
        return state

    def __setstate__(self, state):
        seed, threads, backend, offset = state.pop("_context_settings")
        super().__setstate__(state)
        self.context = _attn.Context(seed=seed, threads=threads, backend=backend)
        self.context.dropout_offset = offset

    def _linear(self, x, weight, bias):
        """x W^T + b: attn's GEMM (_Linear) where the fused kernels run, else torch's F.linear."""
        if _attn_linear_ok(self.context, x, weight, bias):
            return _attn_linear(x, weight, bias, self.context)
        return F.linear(x, weight, bias)

    def _projections(self, query, key, value):
        """q, k, v as (B, L, E) views (unit feature stride), or a packed (B, T, 3E) qkv."""
        E = self.embed_dim
        to_btE = (lambda x: x) if self.batch_first else (lambda x: x.transpose(0, 1))
        if self._qkv_same_embed_dim:
            w, b = self.in_proj_weight, self.in_proj_bias
            if query is key and key is value:
                return None, to_btE(self._linear(query, w, b))
            wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        return (to_btE(self._linear(query, wq, bq)), to_btE(self._linear(key, wk, bk)),
                to_btE(self._linear(value, wv, bv))), None

    def _masks(self, key_padding_mask, attn_mask, is_causal, B, T, S):
        """(valid_lens or None, causal) from nn.MultiheadAttention's masks."""
        op = "attn.torch.MultiheadAttention"
        H = self.num_heads
        if attn_mask is not None:
            attn_mask = _mha_attn_mask(attn_mask, B, H, T, S, op)
        if key_padding_mask is None and attn_mask is None:
            return None, bool(is_causal)
        if _OPS is not None and _compiling():  # the masks' values are checked at run time
            return _OPS.mask_lens(key_padding_mask, attn_mask, B, T, S, H, bool(is_causal),
                                  op), bool(is_causal)
        if attn_mask is not None and not is_causal and _is_causal_mask(attn_mask, T, S, op):
            is_causal = True  # the kernels' causal mode: no per-query lengths
        lens = _mask_lens_op()(key_padding_mask, attn_mask, B, T, S, H, bool(is_causal), op)
        if lens.dim() == 1 and bool((lens == S).all()):
            lens = None  # nothing masked
        return lens, bool(is_causal)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        unbatched = query.dim() == 2
        if unbatched:  # (L, E): one sequence, as torch accepts
            bdim = 0 if self.batch_first else 1
            query, key, value = (x.unsqueeze(bdim) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(f"attn.torch.MultiheadAttention: query {tuple(query.shape)}, key "
                             f"{tuple(key.shape)}, value {tuple(value.shape)}: expected 3-D "
                             f"({'batch, seq' if self.batch_first else 'seq, batch'}, feature) "
                             "or unbatched 2-D inputs")
        if self.batch_first:
            B, T = query.shape[:2]
            S = key.shape[1]
        else:
            T, B = query.shape[:2]
            S = key.shape[0]
        H, E = self.num_heads, self.embed_dim
        _check_tensors("attn.torch.MultiheadAttention", query, key, value)
        lens, causal = self._masks(key_padding_mask, attn_mask, is_causal, B, T, S)
        p = self.dropout if self.training else 0.0
        separate, qkv = self._projections(query, key, value)
        if qkv is not None:
            separate = (qkv[..., :E], qkv[..., E:2 * E], qkv[..., 2 * E:])
        q, k, v = separate
        dtype = q.dtype
        if _fused_heads_ok(dtype, self.context, q, k, v) and q.stride(-1) == 1 and \
                k.stride(-1) == 1 and v.stride(-1) == 1:
            if qkv is not None:
                out = _packed(qkv, H, lens, causal, p, self.training, None, self.masked_rows,
                              self.context)
            else:
                out = _heads(q, k, v, H, lens, causal, p, self.training, None, self.masked_rows,
                             self.context)
        else:  # float64 or the reference backend: heads as batch rows b*H + h
            out = _core(*(_split_heads(x, H).flatten(0, 1) for x in (q, k, v)), lens, H, causal,
                        p, self.training, None, self.masked_rows, self.context)
            out = out.view(B, H, T, E // H).transpose(1, 2).reshape(B, T, E)
        if not self.batch_first:
            out = out.transpose(0, 1)
        out = self._linear(out, self.out_proj.weight, self.out_proj.bias)
        weights = None
        if need_weights:
            _, weights = reference_attention(*(_split_heads(x, H) for x in (q, k, v)), lens, causal,
                                             masked_rows=self.masked_rows, need_weights=True)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if unbatched:
                weights = weights.squeeze(0)
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
        return out, weights


if _torch_version() >= (2, 4):
    from . import _torch_ops as _OPS  # noqa: E402,F811  (registers the attn:: operators)
