"""The oracle: d2l's attention code (chapter "Attention mechanisms and transformers", PyTorch
flavour) restated on Debian's python3-torch, and small torch helpers for the tests.

The behaviour reproduced is the one recorded in the project's reference notes (semantics
sections 1-4): masked_softmax fills masked scores with -1e6 before the softmax (so a row with no
valid key comes out uniform), DotProductAttention divides the scores by sqrt(d) and keeps the
pre-dropout weights, AdditiveAttention scores w_v . tanh(W_q q + W_k k) without scaling,
MultiHeadAttention splits heads batch-major (row b*H + h) and repeats valid_lens per head, and
PositionalEncoding adds the float32 sinusoid table P. One deliberate difference: masked_softmax
here fills a copy, where d2l writes -1e6 into its caller's tensor.
"""

import math
import warnings

import numpy as np
import torch
from torch import nn

# LazyLinear announces itself as experimental on every construction in torch 1.13.
warnings.filterwarnings("ignore", message="Lazy modules are a new feature")


def masked_softmax(X, valid_lens):
    """Softmax over the last axis of X (B, T, S); key s of row (b, t) counts iff s < length."""
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    B, T, S = X.shape
    lens = valid_lens.repeat_interleave(T) if valid_lens.dim() == 1 else valid_lens.reshape(-1)
    rows = X.reshape(-1, S).clone()
    keep = torch.arange(S, dtype=torch.float32)[None, :] < lens[:, None]
    rows[~keep] = -1e6
    return nn.functional.softmax(rows.reshape(B, T, S), dim=-1)


class DotProductAttention(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class AdditiveAttention(nn.Module):
    def __init__(self, num_hiddens, dropout):
        super().__init__()
        self.W_k = nn.LazyLinear(num_hiddens, bias=False)
        self.W_q = nn.LazyLinear(num_hiddens, bias=False)
        self.w_v = nn.LazyLinear(1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens):
        queries, keys = self.W_q(queries), self.W_k(keys)
        # (B, T, 1, h) + (B, 1, S, h) broadcasts to every (query, key) pair
        features = torch.tanh(queries.unsqueeze(2) + keys.unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_hiddens, num_heads, dropout, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_k = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_o = nn.LazyLinear(num_hiddens, bias=bias)

    def split_heads(self, X):  # (B, L, E) -> (B*H, L, E/H), row b*H + h
        B, L, _ = X.shape
        return X.reshape(B, L, self.num_heads, -1).permute(0, 2, 1, 3).reshape(B * self.num_heads, L, -1)

    def merge_heads(self, X):  # (B*H, L, D) -> (B, L, H*D)
        _, L, D = X.shape
        return X.reshape(-1, self.num_heads, L, D).permute(0, 2, 1, 3).reshape(-1, L, self.num_heads * D)

    def forward(self, queries, keys, values, valid_lens):
        queries = self.split_heads(self.W_q(queries))
        keys = self.split_heads(self.W_k(keys))
        values = self.split_heads(self.W_v(values))
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        return self.W_o(self.merge_heads(self.attention(queries, keys, values, valid_lens)))


class PositionalEncoding(nn.Module):
    def __init__(self, num_hiddens, dropout, max_len=1000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.P = torch.zeros((1, max_len, num_hiddens))
        angles = torch.arange(max_len, dtype=torch.float32).reshape(-1, 1) / torch.pow(
            10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens)
        self.P[:, :, 0::2] = torch.sin(angles)
        self.P[:, :, 1::2] = torch.cos(angles)

    def forward(self, X):
        return self.dropout(X + self.P[:, :X.shape[1], :].to(X.device))


class PositionWiseFFN(nn.Module):
    def __init__(self, ffn_num_hiddens, ffn_num_outputs):
        super().__init__()
        self.dense1 = nn.LazyLinear(ffn_num_hiddens)
        self.relu = nn.ReLU()
        self.dense2 = nn.LazyLinear(ffn_num_outputs)

    def forward(self, X):
        return self.dense2(self.relu(self.dense1(X)))


class AddNorm(nn.Module):
    """Post-norm residual: LayerNorm(dropout(Y) + X)."""

    def __init__(self, norm_shape, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(norm_shape)

    def forward(self, X, Y):
        return self.ln(self.dropout(Y) + X)


class TransformerEncoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False):
        super().__init__()
        self.attention = MultiHeadAttention(num_hiddens, num_heads, dropout, use_bias)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)
        self.addnorm2 = AddNorm(num_hiddens, dropout)

    def forward(self, X, valid_lens):
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


class TransformerEncoder(nn.Module):
    def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout,
                 use_bias=False):
        super().__init__()
        self.num_hiddens = num_hiddens
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.pos_encoding = PositionalEncoding(num_hiddens, dropout)
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module("block" + str(i), TransformerEncoderBlock(
                num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias))

    def forward(self, X, valid_lens):
        # The embedding is scaled by sqrt(num_hiddens) before the positions (in [-1, 1]) join.
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        self.attention_weights = [None] * len(self.blks)
        for i, blk in enumerate(self.blks):
            X = blk(X, valid_lens)
            self.attention_weights[i] = blk.attention.attention.attention_weights
        return X


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
