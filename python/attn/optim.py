"""attn.optim: optimisers over one layer's parameters, with PyTorch's update rules.

    mha = attn.MultiHeadAttention(64, 4, 0.1, bias=True)
    opt = attn.optim.AdamW(mha, lr=1e-3)                # torch.optim.AdamW's defaults
    for X, dY in batches:
        Y = mha(X, X, X)
        mha.backward(dY)                                # gradients accumulate into mha.grads
        attn.optim.clip_grad_norm(mha, 1.0)             # optional
        opt.step()
        opt.zero_grad()

SGD(layer, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
AdamW(layer, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    .step(), .zero_grad(), .lr (settable), .state_dict(), .load_state_dict(d), .param_names
clip_grad_norm(layer, max_norm, norm_type=2.0) -> the norm before clipping

Updates run in C++ on the parameters in place (float32, float64 or bfloat16 layers; bf16
layers keep bf16 state, as torch.optim does), each element computed in double and rounded
once. The state dict lets a run resume bit for bit.
"""

from ._attn import AdamW, Optimizer, SGD, clip_grad_norm

__all__ = ["AdamW", "Optimizer", "SGD", "clip_grad_norm"]

for _name in ("AdamW", "Optimizer", "SGD"):
    globals()[_name].__module__ = "attn.optim"
del _name
