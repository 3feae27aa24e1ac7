"""attn: self-attention, multi-head attention and positional encoding, from C++.

The names follow d2l's PyTorch code ("Dive into Deep Learning", chapter "Self-attention and
positional encoding"); arrays are NumPy arrays, passed in and out without copies where the
layout allows, and computation runs with the GIL released.

    import numpy as np, attn
    mha = attn.MultiHeadAttention(100, 5, 0.5).eval()       # num_hiddens, num_heads, dropout
    X = np.ones((2, 4, 100), np.float32)                      # (batch, queries, num_hiddens)
    Y = mha(X, X, X, np.array([3, 2]))                        # (2, 4, 100); valid_lens per batch
    dX_q, dX_k, dX_v = mha.backward(np.ones_like(Y))          # input gradients; mha.grads too

Functions
    masked_softmax(X, valid_lens=None)                         d2l's masked_softmax
    masked_softmax_backward(dY, Y, valid_lens=None)
    scaled_dot_product_attention(q, k, v, valid_lens=None, causal=False, dropout=0.0)
        bfloat16: pass torch.bfloat16 tensors (used in place, results torch.bfloat16) or
        dtype="bfloat16" (NumPy float32 rounded to bf16; float32 results holding bf16 values);
        linear(..., dtype="bfloat16") likewise; DotProductAttention(dropout, dtype="bfloat16")
        and MultiHeadAttention(..., dtype="bfloat16") too, backward included
    sinusoidal_encoding(num_steps, num_hiddens)                d2l's P matrix
    linear(x, weight, bias=None), dropout(x, p, seed=, offset=)
    memory_cache_stats(), release_cached_memory(), set_memory_cache_limit(bytes)
        the cache of freed blocks behind results (ATTN_MEMORY_CACHE_MIB, default 1024)

Layers (subclasses of attn.Module: train()/eval(), state_dict()/load_state_dict(), backward(),
grads, zero_grad(), named_parameters(), context)
    DotProductAttention(dropout)
    AdditiveAttention(num_hiddens, dropout)
    MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)
    PositionalEncoding(num_hiddens, dropout, max_len=1000)
    LearnedPositionalEmbedding(max_len, num_hiddens, dropout=0.0)
    TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False)
    TransformerEncoder(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout,
                       use_bias=False)
    TransformerDecoder(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout,
                       use_bias=False): forward(X, enc_outputs, enc_valid_lens), backward,
                       init_state(enc_outputs, enc_valid_lens, cache_dtype=None|'bfloat16') and
                       step(X, state) (KV cache)
    EncoderDecoder(src_vocab_size, tgt_vocab_size, num_hiddens, ffn_num_hiddens, num_heads,
                   num_enc_blks, num_dec_blks, dropout): forward(enc_X, dec_X, enc_valid_lens),
                   backward, greedy_search(src, lens, bos=, eos=, cache_dtype=None|'bfloat16'),
                   beam_search(...)

Training: Linear(in_features, out_features, bias=True) (an output head; in_features=None: lazy),
cross_entropy(logits, targets, valid_lens=None) and cross_entropy_backward(...) (the loss and
its gradient; cross_entropy_with_grad(...) both in one pass), attn.optim.SGD(layer, lr, ...), attn.optim.AdamW(layer, ...) (torch.optim's rules,
step()/zero_grad()/state_dict()), attn.optim.clip_grad_norm(layer, max_norm)

Data parallel: attn.distributed (world(), Communicator.allreduce/broadcast/barrier,
DistributedDataParallel; `mpirun -np N python3 train.py`), Context.dropout_first_sample.

Inside PyTorch: `import attn.torch` (not imported here, so attn needs no torch) gives
attn.torch.scaled_dot_product_attention (F.scaled_dot_product_attention's arguments plus d2l's
valid_lens, fused forward and backward) and attn.torch.MultiheadAttention (a drop-in
torch.nn.MultiheadAttention); on PyTorch >= 2.4 custom operators that torch.compile traces.

Errors: attn.Error (a ValueError) carries the C++ library's message, which names the operation,
the shapes and what was expected; .op is the operation's name.

Everything else: docs/python.md in the source tree.
"""

from ._attn import (  # noqa: F401  (re-exported API)
    AdditiveAttention,
    Context,
    DotProductAttention,
    Error,
    LearnedPositionalEmbedding,
    Linear,
    Module,
    MultiHeadAttention,
    PositionalEncoding,
    __version__,
    cross_entropy,
    cross_entropy_backward,
    cross_entropy_with_grad,
    default_context,
    dropout,
    linear,
    masked_softmax,
    masked_softmax_backward,
    memory_cache_stats,
    release_cached_memory,
    set_memory_cache_limit,
    scaled_dot_product_attention,
    sinusoidal_encoding,
)
from ._attn import _input_view  # noqa: F401  (testing aid, not part of the API)

__all__ = [
    "AdditiveAttention",
    "Context",
    "DotProductAttention",
    "Error",
    "LearnedPositionalEmbedding",
    "Linear",
    "Module",
    "MultiHeadAttention",
    "PositionalEncoding",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_with_grad",
    "default_context",
    "dropout",
    "linear",
    "masked_softmax",
    "masked_softmax_backward",
    "scaled_dot_product_attention",
    "sinusoidal_encoding",
]

# Optional layers that exist only when the C++ library was built with them.
from . import _attn as _ext

for _name in ("TransformerEncoder", "TransformerEncoderBlock", "TransformerDecoder",
              "EncoderDecoder", "DecoderState"):
    if hasattr(_ext, _name):
        globals()[_name] = getattr(_ext, _name)
        __all__.append(_name)
del _ext, _name

from . import optim  # noqa: E402  (attn.optim: SGD, AdamW, clip_grad_norm)
from . import distributed  # noqa: E402  (attn.distributed: Communicator, DistributedDataParallel)

__all__ += ["optim", "distributed"]

# Show the public names as attn.X (not attn._attn.X) in reprs and tracebacks.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = "attn"
del _obj, _name
