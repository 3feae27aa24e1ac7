"""Data-parallel training from Python with attn.distributed: a Transformer encoder and a Linear
head learn to copy every sequence's first token to all its positions (only attention can carry
it there), on global batches split over the ranks.

    python3 examples/python_data_parallel.py                  # one process
    mpirun -np 2 python3 examples/python_data_parallel.py     # 2 ranks: the same losses
    # as root in a container: OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;
    # shared memory without ptrace rights: --mca btl_vader_single_copy_mechanism none

Needs attn built with -DATTN_WITH_MPI=ON for mpirun (PYTHONPATH=build/default/python, or the
installed module). Every rank builds the same global batch from the step's seed and computes
its rows; rank 0 prints. --threads is per rank. The last line gives tokens/s (global tokens per
second of the training loop after the first step).
"""

import argparse
import time

import numpy as np

import attn
import attn.distributed as dist


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--length", type=int, default=48)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--num-hiddens", type=int, default=64)
    p.add_argument("--num-blks", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--after-backward", action="store_true",
                   help="plain backward calls, every gradient reduced after them (no overlap)")
    args = p.parse_args()

    comm = dist.world()  # MPI under mpirun, else one process
    E, V, T, B = args.num_hiddens, args.vocab, args.length, args.batch_size
    enc = attn.TransformerEncoder(V, E, 2 * E, 4, args.num_blks, args.dropout, seed=1,
                                  threads=args.threads)
    head = attn.Linear(E, V, seed=2, threads=args.threads)
    enc.eval()(np.zeros((1, T), np.int64))  # a dry run creates d2l's lazy projections
    enc.train()
    ddp = dist.DistributedDataParallel([enc, head])  # checks the model, copies rank 0's
    opts = [attn.optim.AdamW(m, lr=args.lr, weight_decay=0.0) for m in (enc, head)]

    start = None
    for step in range(1, args.steps + 1):
        rng = np.random.default_rng(step)  # the global batch: the same on every rank
        tokens = rng.integers(0, V, size=(B, T))
        ids, targets = ddp.shard(tokens, np.repeat(tokens[:, :1], T, axis=1))
        logits = head(enc(ids))
        loss = np.array([attn.cross_entropy(logits, targets)])
        dlogits = attn.cross_entropy_backward(logits, targets)
        if args.after_backward:
            enc.backward(head.backward(dlogits))
        else:
            dX = ddp.backward(head, dlogits)  # the head's bucket starts now
            ddp.backward(enc, dX)  # block by block, each bucket's allreduce starts at once
        ddp.synchronize()  # mean over ranks = the global batch's gradient (equal shards)
        comm.allreduce(loss, "mean")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if step == 1:
            start = time.perf_counter()
        if comm.rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step}: loss {loss[0]:.4f}", flush=True)
    if comm.rank == 0 and args.steps > 1:
        seconds = time.perf_counter() - start
        tokens_per_s = (args.steps - 1) * B * T / seconds
        print(f"{comm.size} rank(s) x {args.threads} thread(s): {tokens_per_s:,.0f} tokens/s "
              f"({args.steps - 1} steps in {seconds:.2f} s)")


if __name__ == "__main__":
    main()
