"""Data-parallel training from Python under mpirun (CTest: python_mpi_*; not collected by pytest).

    mpirun -np N python3 dp_train.py train      N ranks train a Transformer encoder with dropout
                                                and a Linear head (attn.distributed's
                                                DistributedDataParallel, which replaces the other
                                                ranks' initial weights by rank 0's) for 20 steps on global
                                                batches of 8; rank 0 then trains the same model
                                                in one process with a plain loop and checks that
                                                every step's loss agrees within 1e-5 relative.
    mpirun -np N python3 dp_train.py train-uneven   the same with global batches of 9 (shards of
                                                different sizes) and ignored targets: summed
                                                losses over the global count, synchronize(average=False).
    mpirun -np N python3 dp_train.py fault      rank 1 raises at step 3 while the others wait in
                                                the gradient allreduce: the run must end (non-zero,
                                                the traceback printed), not hang.
    mpirun -np N python3 dp_train.py mismatch   rank 1 wraps another model, then one with another
                                                dropout seed (attn.Error on every rank, caught),
                                                then passes an array of another shape to
                                                allreduce: attn.Error on every rank, the run ends.
"""

import sys

import numpy as np

import attn
import attn.distributed as dist

VOCAB, T, B, STEPS, DROPOUT = 8, 6, 8, 20, 0.1


def batches(uneven=False):
    """The global batches every rank sees (the task of python/tests/test_train.py: every
    position predicts its sequence's first token). uneven: 9 sequences (shards of different
    sizes on 2 and 4 ranks) with about a fifth of the targets ignored (-100)."""
    rng = np.random.default_rng(7)
    for _ in range(STEPS):
        tokens = rng.integers(0, VOCAB, size=(B + uneven, T))
        targets = np.repeat(tokens[:, :1], T, axis=1)
        if uneven:
            targets[rng.random(targets.shape) < 0.2] = -100
        yield tokens, targets


def model():
    enc = attn.TransformerEncoder(VOCAB, 16, 32, 2, 2, DROPOUT, seed=1, threads=1)
    head = attn.Linear(16, VOCAB, seed=2, threads=1)
    enc.eval()(np.zeros((1, T), np.int64))  # a dry run materialises d2l's lazy projections
    enc.train()
    return enc, head


def optimizers(enc, head):
    return [attn.optim.AdamW(m, lr=3e-3, weight_decay=0.0) for m in (enc, head)]


def train_parallel(comm, fault=False, uneven=False):
    enc, head = model()
    if comm.rank > 0:  # other weights than rank 0's: DistributedDataParallel copies rank 0's
        for m in (enc, head):
            m.load_state_dict({k: v + 0.5 for k, v in m.state_dict().items()})
    ddp = dist.DistributedDataParallel([enc, head], comm)
    opts = optimizers(enc, head)
    losses = []
    for step, (ids, targets) in enumerate(batches(uneven), 1):
        kept = int((targets != -100).sum())  # the global batch's
        ids, targets = ddp.shard(ids, targets)
        logits = head(enc(ids))
        if uneven:
            # Shards of different sizes: each rank's summed loss over the global count, and the
            # sum over ranks (docs/python.md, "Averaging equals the global gradient").
            loss = np.array([attn.cross_entropy(logits, targets, reduction="sum") / kept])
            dlogits = attn.cross_entropy_backward(logits, targets, reduction="sum",
                                                  grad_loss=1.0 / kept)
        else:
            loss = np.array([attn.cross_entropy(logits, targets)])
            dlogits = attn.cross_entropy_backward(logits, targets)
        dX = ddp.backward(head, dlogits)
        if fault and step == 3 and comm.rank == 1:
            raise RuntimeError("rank 1 failed on purpose at step 3")
        ddp.backward(enc, dX)
        # Equal shards: the mean over ranks is the global batch's gradient; uneven: the sum.
        ddp.synchronize(average=not uneven)
        comm.allreduce(loss, "sum" if uneven else "mean")
        losses.append(float(loss[0]))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return losses


def train_single(uneven=False):
    enc, head = model()
    opts = optimizers(enc, head)
    losses = []
    for ids, targets in batches(uneven):
        logits = head(enc(ids))
        losses.append(attn.cross_entropy(logits, targets))
        enc.backward(head.backward(attn.cross_entropy_backward(logits, targets)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return losses


def main(mode):
    comm = dist.world()
    assert comm.size > 1, "run under mpirun with 2 or more ranks"
    if mode == "mismatch":
        # Another model on rank 1: an attn.Error on every rank, caught here.
        other = attn.Linear(16 if comm.rank != 1 else 17, VOCAB)
        try:
            dist.DistributedDataParallel([other], comm)
            raise AssertionError("different models were accepted")
        except attn.Error as e:
            assert "gradient buckets (dtype, elements per bucket) differs across ranks" in str(e)
        # Another dropout seed on rank 1: refused too.
        enc = model()[0]
        enc.seed = 1 + comm.rank
        try:
            dist.DistributedDataParallel([enc], comm)
            raise AssertionError("different dropout seeds were accepted")
        except attn.Error as e:
            assert "dropout streams" in str(e), e
        # broadcast of an int32 array: rank 0's everywhere.
        seeds = np.full(3, 10 + comm.rank, np.int32)
        assert (comm.broadcast(seeds, 0) == 10).all()
        # Arrays of another shape on rank 1, not caught: the run ends.
        comm.allreduce(np.zeros(4 if comm.rank == 1 else 3, np.float32))
        raise AssertionError("the mismatched allreduce returned")
    uneven = mode == "train-uneven"
    parallel = train_parallel(comm, fault=mode == "fault", uneven=uneven)
    if mode == "fault":
        raise AssertionError("the fault did not end the run")
    if comm.rank != 0:
        return
    single = train_single(uneven)
    for step, (a, b) in enumerate(zip(single, parallel), 1):
        print(f"step {step:2d}: loss {a:.7f} (1 process) {b:.7f} ({comm.size} ranks)")
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: 1 process {a}, {comm.size} ranks {b}"
    assert uneven or single[-1] < single[0], "the model did not learn"
    print(f"dp_train: {comm.size} ranks train the model one process trains "
          f"(dropout {DROPOUT}, {STEPS} steps, global batch {B + uneven}"
          f"{', uneven shards, ignored targets' if uneven else ''})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "train")
