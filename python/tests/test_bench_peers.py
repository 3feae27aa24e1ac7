"""attn's side of the peer benchmarks (bench/peers_*.py) still runs.

Those scripts time attn against PyTorch 2.x, ONNX Runtime and OpenVINO from PyPI, so they run
only where bench/peers-venv.sh made its environment, never in CI; a change to attn's Python API
could break them unseen. It did: attn.torch.scaled_dot_product_attention took
F.scaled_dot_product_attention's positional arguments (attn_mask fourth) and every padded attn
case of bench/peers_attention.py raised until it passed valid_lens= by name. Here each script's
attn engine runs on tiny cases, one repetition, with this build's module.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def run_script(script, *args):
    """The JSON rows a bench/ script prints, run by this interpreter with this environment."""
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), *args],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, f"{script} failed:\n{out.stderr[-3000:]}"
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_peers_attention_runs_attn_on_every_kind_of_case():
    cases = [f"{p}:{d}:2:2:16:8:{m}" for p in ("forward", "backward") for d in ("fp32", "bf16")
             for m in ("none", "pad")]
    rows = run_script("peers_attention.py", "--engine", "attn", "--threads", "1", "--min-time",
                      "0", "--min-reps", "1", "--max-reps", "1", *cases)
    assert [r["case"] for r in rows] == cases
    for r in rows:
        assert "skipped" not in r, r
        assert r["flops"] > 0 and r["reps"] == 1


@pytest.mark.parametrize("autocast", [False, True])
def test_peers_seq2seq_runs_attn_training_steps(autocast):
    (row,) = run_script("peers_seq2seq.py", "--engine", "attn", "--threads", "1", "--shape",
                        "dates", "--min-time", "0", *(["--autocast"] if autocast else []))
    assert row["engine"] == "attn" and row["tokens_per_second"] > 0
    assert row["autocast"] == autocast
    assert len(row["first_losses"]) == 2 and all(x > 0 for x in row["first_losses"])
