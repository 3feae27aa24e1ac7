"""attn.distributed in one process: the communicator of size 1, its errors, and
DistributedDataParallel's pieces (shard, buckets, synchronize). The multi-rank runs are
python/tests/mpi/dp_train.py under mpirun (CTest: python_mpi_dp_*)."""

import numpy as np
import pytest

import attn
import attn.distributed as dist


def test_world_without_mpirun_is_one_process():
    comm = dist.world()
    assert (comm.rank, comm.size, comm.backend) == (0, 1, "single")
    assert dist.world() is not None and dist.get_rank() == 0 and dist.get_world_size() == 1
    assert repr(comm) == "Communicator(backend='single', rank=0, size=1)"
    assert isinstance(dist.is_mpi_available(), bool)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["sum", "mean", "min", "max"])
def test_collectives_of_one_rank_are_the_identity(dtype, op):
    a = np.arange(6, dtype=dtype).reshape(2, 3)
    out = dist.all_reduce(a, op)
    assert out is a
    np.testing.assert_array_equal(a, np.arange(6, dtype=dtype).reshape(2, 3))
    assert dist.broadcast(a, 0) is a
    dist.barrier()


def test_broadcast_takes_any_dtype():
    for a in (np.arange(3, dtype=np.int32), np.array([True, False]), np.zeros((2, 2), np.uint8)):
        assert dist.broadcast(a) is a


def test_int64_reduces_with_sum_min_max_but_not_mean():
    a = np.array([3, 4], np.int64)
    dist.all_reduce(a, "max")
    with pytest.raises(attn.Error, match=r"allreduce.*dtype int64 .*expected float32 or float64"):
        dist.all_reduce(a, "mean")


def test_collective_errors_name_the_op_dtype_and_shape():
    comm = dist.world()
    with pytest.raises(attn.Error, match=r"allreduce.*dtype int32 and shape \(4,\)") as e:
        comm.allreduce(np.zeros(4, np.int32))
    assert e.value.op == "allreduce" and isinstance(e.value, ValueError)
    with pytest.raises(attn.Error, match=r"allreduce.*shape \(3, 2\) is not C-contiguous"):
        comm.allreduce(np.zeros((2, 3), np.float32).T)
    ro = np.zeros(3, np.float32)
    ro.setflags(write=False)
    with pytest.raises(attn.Error, match="read-only"):
        comm.allreduce(ro)
    with pytest.raises(attn.Error, match="expects a NumPy array"):
        comm.allreduce([1.0, 2.0])
    with pytest.raises(attn.Error, match="op 'prod' unsupported"):
        comm.allreduce(np.zeros(2, np.float32), "prod")
    with pytest.raises(attn.Error, match=r"broadcast.*root 1 is outside \[0, 1\)"):
        comm.broadcast(np.zeros(2, np.float32), 1)


def test_shard_range_splits_as_the_cpp_trainer():
    assert [dist.shard_range(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert dist.shard_range(8, 0, 1) == (0, 8)
    with pytest.raises(attn.Error, match="3 samples, fewer than the 4 ranks"):
        dist.shard_range(3, 0, 4)


def test_context_exposes_the_dropout_sample_window():
    ctx = attn.Context(seed=3)
    assert ctx.dropout_first_sample == 0
    ctx.dropout_first_sample = 5
    assert ctx.dropout_first_sample == 5


def test_dropout_masks_follow_the_global_sample(rng):
    # Rows [2, 4) of a batch computed alone, with dropout_first_sample = 2, draw the masks the
    # whole batch draws for them: the property data parallelism relies on.
    enc = attn.TransformerEncoder(7, 16, 32, 2, 2, 0.3, seed=1)
    ids = rng.integers(0, 7, size=(4, 5))
    full = enc(ids)
    enc.context.dropout_offset = 0
    enc.context.dropout_first_sample = 2
    part = enc(ids[2:])
    np.testing.assert_allclose(part, full[2:], rtol=1e-6, atol=1e-6)
    enc.context.dropout_first_sample = 0
    enc.context.dropout_offset = 0
    assert not np.allclose(enc(ids[2:]), full[2:], atol=1e-3)  # another window, other masks


def test_ddp_on_one_rank_is_plain_training(rng):
    def build():
        enc = attn.TransformerEncoder(6, 16, 32, 2, 2, 0.2, seed=4)
        head = attn.Linear(16, 6, seed=5)
        return enc, head

    ids = rng.integers(0, 6, size=(4, 5))
    targets = rng.integers(0, 6, size=(4, 5))
    enc_a, head_a = build()
    enc_b, head_b = build()
    with pytest.raises(attn.Error, match="'blks.block0.attention.W_q.weight' does not exist yet"):
        dist.DistributedDataParallel([enc_b, head_b])  # d2l's lazy projections: dry run first
    for enc in (enc_a, enc_b):
        enc.eval()(ids[:1])
        enc.train()
    ddp = dist.DistributedDataParallel([enc_b, head_b])
    # A bucket per encoder block (last block first), then embedding, then the head.
    per_block = sum(v.size for k, v in enc_b.state_dict().items() if k.startswith("blks.block0."))
    assert ddp.bucket_sizes[:2] == [per_block, per_block]
    assert sum(ddp.bucket_sizes) == enc_b.num_parameters + head_b.num_parameters
    assert "DistributedDataParallel([TransformerEncoder, Linear], rank=0, size=1" in repr(ddp)
    # Plain.
    logits = head_a(enc_a(ids))
    enc_a.backward(head_a.backward(attn.cross_entropy_backward(logits, targets)))
    # Through DDP (1 rank: the shard is the whole batch, the mean over ranks the identity).
    ids_s, targets_s = ddp.shard(ids, targets)
    assert ids_s.shape == ids.shape and enc_b.context.dropout_first_sample == 0
    logits_b = head_b(enc_b(ids_s))
    assert ddp._reducer.in_flight == 0
    dX = ddp.backward(head_b, attn.cross_entropy_backward(logits_b, targets_s))
    assert ddp._reducer.in_flight == 1  # the head's bucket, before the encoder's backward
    assert ddp.backward(enc_b, dX) is None
    assert ddp._reducer.in_flight == 4  # + 2 blocks + the embedding
    ddp.synchronize()
    assert ddp._reducer.in_flight == 0
    np.testing.assert_array_equal(logits_b, logits)
    for a, b in ((enc_a, enc_b), (head_a, head_b)):
        for name, g in a.grads.items():
            np.testing.assert_array_equal(b.grads[name], g, err_msg=name)
    # After plain backward calls, synchronize reduces everything at once.
    enc_b.zero_grad()
    head_b.zero_grad()
    enc_b.backward(head_b.backward(attn.cross_entropy_backward(logits_b, targets_s)))
    ddp.synchronize(average=True)
    np.testing.assert_array_equal(head_b.grads["weight"], head_a.grads["weight"])


def test_ddp_errors(rng):
    enc = attn.TransformerEncoder(6, 16, 32, 2, 1, 0.0, seed=4)
    enc(np.zeros((1, 2), np.int64))  # materialise the lazy projections
    head = attn.Linear(16, 6)
    with pytest.raises(attn.Error, match="expects attn.Module objects"):
        dist.DistributedDataParallel([enc, "head"])
    with pytest.raises(attn.Error, match="listed twice"):
        dist.DistributedDataParallel([enc, enc])
    with pytest.raises(attn.Error, match="'weight' does not exist yet .*lazy"):
        dist.DistributedDataParallel([attn.Linear(None, 3)])
    with pytest.raises(attn.Error, match="bfloat16"):
        dist.DistributedDataParallel([attn.MultiHeadAttention(8, 2, 0.0, dtype="bfloat16")])
    ddp = dist.DistributedDataParallel(enc)
    with pytest.raises(attn.Error, match="is not one of the modules"):
        ddp.backward(head, np.zeros((2, 3, 16), np.float32))
    # A second backward through DDP before synchronize() would be lost: refused.
    enc(np.zeros((2, 3), np.int64))
    ddp.backward(enc, np.ones((2, 3, 16), np.float32))
    enc(np.zeros((2, 3), np.int64))
    with pytest.raises(attn.Error, match="already being reduced .*call synchronize"):
        ddp.backward(enc, np.ones((2, 3, 16), np.float32))
    ddp.synchronize()
    enc(np.zeros((2, 3), np.int64))
    ddp.backward(enc, np.ones((2, 3, 16), np.float32))  # fine again after synchronize()
    ddp.synchronize()
    with pytest.raises(attn.Error, match="array 1 has 3 rows, array 0 has 4"):
        ddp.shard(np.zeros((4, 2)), np.zeros((3, 2)))


def test_uncaught_exception_report_is_one_write(monkeypatch):
    # With several ranks on one terminal, each rank's report (the traceback and the abort line)
    # must reach stderr in one write, or two ranks' reports interleave mid-line (CI saw
    # "attnattn.Error: .allreduce" and the fault test's pattern missed).
    import os
    import sys
    import attn.distributed as d

    class Comm:
        rank, size, aborted = 1, 2, None

        def abort(self, code):
            Comm.aborted = code

    read_end, write_end = os.pipe()

    class Stream:
        encoding = "utf-8"

        def fileno(self):
            return write_end

        def write(self, text):
            raise AssertionError("the report went through write(), in pieces")

        def flush(self):
            pass

    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(data) or real_write(fd, data))
    monkeypatch.setattr(sys, "stderr", Stream())
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    d._abort_on_uncaught(Comm())
    try:
        raise attn.Error("allreduce: shapes differ across ranks")
    except attn.Error as e:
        sys.excepthook(type(e), e, e.__traceback__)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    assert len(writes) == 1, writes
    assert text.startswith("Traceback (most recent call last):"), text
    assert "attn.Error: allreduce: shapes differ across ranks\n" in text
    assert text.endswith("attn.distributed: rank 1 of 2 raised Error; ending every rank "
                         "(MPI_Abort)\n"), text
    assert Comm.aborted == 1
