"""The Python tests' view of the one d2l oracle, tests/fixtures/d2l_reference.py (the code the
fixture generator runs): its modules re-exported, d2l's own LazyLinear constructors for
AdditiveAttention(num_hiddens, dropout) and MultiHeadAttention(num_hiddens, num_heads, dropout,
bias), and small torch helpers for the tests.

The behaviour reproduced is the one recorded in the project's reference notes (semantics
sections 1-4). One difference from the oracle: masked_softmax here fills a copy (the tests take
gradients with respect to X itself), where d2l and the oracle write -1e6 into the caller's tensor.
"""

import importlib.util
import math
import os
import sys
import warnings

import numpy as np
import torch

# LazyLinear announces itself as experimental on every construction in torch 1.13.
warnings.filterwarnings("ignore", message="Lazy modules are a new feature")

_ORACLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                            "fixtures", "d2l_reference.py")
_spec = importlib.util.spec_from_file_location("attn_d2l_oracle", _ORACLE_PATH)
_oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_oracle)
sys.modules["attn_d2l_oracle"] = _oracle

from attn_d2l_oracle import (AddNorm, DotProductAttention, EncoderClassifier,  # noqa: E402,F401
                             EncoderDecoder, PositionalEncoding, PositionWiseFFN,
                             TransformerDecoder, TransformerDecoderBlock, TransformerEncoder,
                             TransformerEncoderBlock, d2l_positional_table, seq2seq_loss)


def masked_softmax(X, valid_lens):
    """d2l's masked_softmax of a copy of X (B, T, S); key s of row (b, t) counts iff s < length."""
    return _oracle.masked_softmax(X.clone(), valid_lens)


def AdditiveAttention(num_hiddens, dropout):
    """d2l's AdditiveAttention(num_hiddens, dropout) with its LazyLinear projections."""
    return _oracle.AdditiveAttention(None, None, num_hiddens, dropout)


def MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False):
    """d2l's MultiHeadAttention(num_hiddens, num_heads, dropout, bias) with LazyLinear."""
    return _oracle.MultiHeadAttention(None, num_hiddens, num_heads, dropout, bias)


# ------------------------------------------------------------------------------------------------
# Helpers

def t(a, grad=False):
    """A torch tensor over a NumPy array (a copy, so autograd never sees NumPy memory)."""
    x = torch.tensor(np.array(a))
    if grad:
        x.requires_grad_(True)
    return x


def n(x):
    """NumPy copy of a torch tensor."""
    return x.detach().cpu().numpy().copy()


def state_dict_numpy(module):
    return {k: n(v) for k, v in module.state_dict().items()}


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(D) masked to keys j <= i) v, as torch's is_causal (tril) defines it."""
    T, S = q.shape[1], k.shape[1]
    scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    allowed = torch.ones(T, S, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.bmm(weights, v), weights
