"""attn.distributed: data-parallel training from Python, over MPI (names as torch.distributed).

    import numpy as np, attn, attn.distributed as dist
    comm = dist.world()                   # MPI under mpirun (attn built with MPI), else 1 process
    enc = attn.TransformerEncoder(V, 32, 64, 4, 2, 0.1, seed=1)
    head = attn.Linear(32, V, seed=2)
    enc.eval()(np.zeros((1, T), np.int64)); enc.train()  # dry run: d2l's lazy projections
    ddp = dist.DistributedDataParallel([enc, head])     # same parameters as rank 0 from here
    opts = [attn.optim.AdamW(m) for m in (enc, head)]
    for ids, targets in global_batches:                 # every rank sees the same global batch
        ids, targets = ddp.shard(ids, targets)          # this rank's rows; dropout follows them
        logits = head(enc(ids))
        loss = attn.cross_entropy(logits, targets)
        dX = ddp.backward(head, attn.cross_entropy_backward(logits, targets))
        ddp.backward(enc, dX)             # each block's gradients travel as soon as they are final
        ddp.synchronize()                 # waits; grads = the mean over ranks
        for opt in opts: opt.step(); opt.zero_grad()

    mpirun -np 2 python3 train.py

world() -> Communicator          .rank, .size, .backend ('single' or 'mpi'),
                                 .allreduce(a, op='sum'|'mean'|'min'|'max'), .broadcast(a, root=0),
                                 .barrier(), .abort(code=1); arrays are updated in place
get_rank(), get_world_size(), all_reduce(a, op='sum'), broadcast(a, src=0), barrier()
is_mpi_available()               attn was built with MPI (-DATTN_WITH_MPI=ON)
shard_range(n, rank, size)       (lo, hi): rank's rows of a global batch of n, [n*r/N, n*(r+1)/N)
DistributedDataParallel(modules, comm=None, broadcast_parameters=True)
    .shard(*arrays), .backward(module, grad_output), .synchronize(average=True),
    .broadcast_parameters(src=0), .comm, .modules, .bucket_sizes

Faults: once world() runs on more than one rank, an exception that nothing catches on any rank
ends the whole run (MPI_Abort, after printing the traceback), as `python -m mpi4py` does, so
the other ranks do not wait forever in a collective. Mismatched arrays or models across ranks
are attn.Error on every rank.

Open MPI from a Python extension: CPython loads extensions with RTLD_LOCAL, which hides libmpi's
symbols from the plugins MPI_Init loads; world() re-opens libmpi with RTLD_GLOBAL first (as
mpi4py does), so no preloading is needed. mpi4py is not needed either (and can be used beside
attn: both then share one MPI_COMM_WORLD; attn initialises MPI only if nobody has).
"""

import os
import sys
import threading
import traceback

from . import _attn as _ext
from ._attn import Communicator

__all__ = [
    "Communicator",
    "DistributedDataParallel",
    "all_reduce",
    "barrier",
    "broadcast",
    "get_rank",
    "get_world_size",
    "is_mpi_available",
    "shard_range",
    "world",
]

Communicator.__module__ = "attn.distributed"

_lock = threading.Lock()
_abort_hook_installed = False


def is_mpi_available():
    """True when attn was built with MPI (-DATTN_WITH_MPI=ON)."""
    return _ext._mpi_available()


def _write_whole(text):
    """Writes text to standard error in as few write calls as the pipe takes (one, up to its
    size), so that it does not interleave with what other processes write to the same terminal."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stream (a notebook, a test)
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    data = text.encode(sys.stderr.encoding or "utf-8", "backslashreplace")
    while data:
        data = data[os.write(fd, data):]


def _abort_on_uncaught(comm):
    """Chains sys.excepthook: print the traceback as usual, then end every rank (MPI_Abort)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            ending = (f"attn.distributed: rank {comm.rank} of {comm.size} raised "
                      f"{kind.__name__}; ending every rank (MPI_Abort)\n")
            if previous is sys.__excepthook__:
                # The whole report in one write: the ranks share the terminal, and Python's own
                # hook writes a traceback in pieces that interleave with another rank's.
                _write_whole("".join(traceback.format_exception(kind, value, tb)) + ending)
            else:
                previous(kind, value, tb)
                sys.stderr.write(ending)
                sys.stderr.flush()
        finally:
            comm.abort(1)

    sys.excepthook = hook


def world():
    """The run's Communicator: MPI_COMM_WORLD when attn was built with MPI and the process was
    started by mpirun (or another MPI launcher); the single-process one (rank 0 of 1) otherwise,
    so a script runs unchanged without mpirun. Created on the first call (MPI_Init then; MPI is
    finalized at exit). With more than one rank, an uncaught exception ends every rank."""
    global _abort_hook_installed
    comm = _ext._world()
    with _lock:
        if comm.size > 1 and not _abort_hook_installed:
            _abort_on_uncaught(comm)
            _abort_hook_installed = True
    return comm


def get_rank():
    return world().rank


def get_world_size():
    return world().size


def all_reduce(array, op="sum"):
    """world().allreduce(array, op): in place over every rank; returns the array."""
    return world().allreduce(array, op)


def broadcast(array, src=0):
    """world().broadcast(array, src): every rank's array becomes rank src's; returns it."""
    return world().broadcast(array, src)


def barrier():
    world().barrier()


def shard_range(n, rank, size):
    """Rows [lo, hi) of a global batch of n that rank `rank` of `size` computes: n*r//N to
    n*(r+1)//N (the C++ Trainer's split). Every rank gets at least one row: n < size is an
    attn.Error."""
    if size < 1 or not 0 <= rank < size:
        raise _ext.Error(f"shard_range: rank {rank} is outside [0, {size})")
    if n < size:
        raise _ext.Error(f"shard_range: the global batch has {n} samples, fewer than the "
                         f"{size} ranks")
    return n * rank // size, n * (rank + 1) // size


class DistributedDataParallel:
    """Data parallelism over the ranks of `comm` (default world()) for a set of attn modules
    trained together (an encoder and its head, say), as torch.nn.parallel.DistributedDataParallel
    for one module:

    - construction checks that every rank wraps the same model (parameter buckets of the same
      dtypes and sizes) and, with broadcast_parameters=True, copies rank 0's parameters to all.
      The parameters must exist: d2l's attention projections are lazy, so run one forward
      first (a dry run, as torch's DDP needs for lazy modules), e.g. enc.eval()(ids[:1]) then
      enc.train(); float32 or float64 modules (not bfloat16);
    - shard(*arrays) returns this rank's rows of a global batch and sets every wrapped module's
      context.dropout_first_sample to the first row's global index, so dropout masks follow the
      global sample and N ranks train the model one process trains at the same global batch;
    - backward(module, grad_output) runs module.backward and starts the non-blocking allreduce of
      its gradients as soon as they are final: one bucket per TransformerEncoder block (started
      while the earlier blocks' backward still runs), one bucket for any other module (started
      when its backward returns);
    - synchronize(average=True) starts whatever backward did not (plain module.backward calls
      work too: then everything is reduced after backward), waits, and writes the mean (or with
      average=False the sum) over the ranks into the modules' grads. Call it before clipping and
      the optimiser step.

    The mean of the ranks' gradients is the global batch's gradient when the loss is a mean and
    the shards are equal (global batch divisible by the ranks, the same number of kept
    positions). Otherwise take reduction='sum' with grad_loss=1/(kept positions of the global
    batch) and synchronize(average=False), as the C++ Trainer does.
    """

    def __init__(self, modules, comm=None, broadcast_parameters=True):
        if isinstance(modules, _ext.Module):
            modules = [modules]
        self.modules = list(modules)
        self.comm = comm if comm is not None else world()
        self._reducer = _ext._Reducer(self.modules, self.comm)
        if broadcast_parameters:
            self.broadcast_parameters(0)

    @property
    def bucket_sizes(self):
        """Elements in each gradient bucket, in the order backward fills them."""
        return self._reducer.bucket_sizes

    def broadcast_parameters(self, src=0):
        """Every rank's parameters become rank src's (collective)."""
        self._reducer.broadcast_parameters(src)

    def shard(self, *arrays):
        """This rank's rows [lo, hi) (shard_range) of each array's first axis; sets the wrapped
        modules' context.dropout_first_sample to lo. Returns one array for one argument, else a
        tuple. Every array must have the same first dimension (the global batch)."""
        if not arrays:
            raise _ext.Error("DistributedDataParallel.shard: expects at least one array")
        n = len(arrays[0])
        for i, a in enumerate(arrays):
            if len(a) != n:
                raise _ext.Error(f"DistributedDataParallel.shard: array {i} has {len(a)} rows, "
                                 f"array 0 has {n}: every array must hold the global batch")
        lo, hi = shard_range(n, self.comm.rank, self.comm.size)
        for m in self.modules:
            m.context.dropout_first_sample = lo
        parts = tuple(a[lo:hi] for a in arrays)
        return parts[0] if len(parts) == 1 else parts

    def backward(self, module, grad_output):
        """module.backward(grad_output), starting the reduction of its gradients as they become
        final; returns what module.backward returns."""
        return self._reducer.backward(module, grad_output)

    def synchronize(self, average=True):
        """Waits for every bucket (starting those not started) and writes the reduced gradients
        (mean over ranks, or the sum with average=False) into the modules' grads."""
        self._reducer.synchronize(average)

    def __repr__(self):
        names = ", ".join(type(m).__name__ for m in self.modules)
        return (f"DistributedDataParallel([{names}], rank={self.comm.rank}, "
                f"size={self.comm.size}, buckets={len(self.bucket_sizes)})")
