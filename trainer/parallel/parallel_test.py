"""Every layout equals one process: the same losses, gradient norms and final weights.

One torchrun launch of 4 gloo processes trains the tiny model of proof.py under each layout
(3 steps, 2 micro-batches of 4 packed rows), and a run that changes layout through a
distributed checkpoint; this process trains it alone, the trainer's way, and compares.
Tolerances (fp32): losses and norms relative 1e-5, weights absolute 2e-4 (AdamW divides by
the root of the second moment, so a weight with a near-zero gradient amplifies the last-bit
differences of a sum taken in another order; measured: at most ~4e-5).
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.parallel import proof
from trainer.sizing import comm

LAYOUTS = (
    "tp2",  # dp2 x tp2
    "tp2+sp",  # dp2 x tp2 with sequence parallel
    "pp2:GPIPE",  # dp2 x pp2
    "pp2:ONE_F_ONE_B",
    "pp2:INTERLEAVED_1F1B",  # 2 stages per rank, 4 in all
    "cp2",  # dp2 x cp2
    "pp2:ONE_F_ONE_B,tp2+sp",  # 2-D model parallel: pp2 x tp2
    "cp2,tp2",  # cp2 x tp2
    "resume:tp2>dp4",  # two steps under TP, the third under plain data parallel
    "resume:cp2,tp2>pp2:GPIPE",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("proof")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4"]
    cmd += ["--standalone", "-m", "trainer.parallel.proof", str(out), *LAYOUTS]
    assert run_group(cmd, env) == 0
    return out


def run_group(cmd: list[str], env: dict, timeout: float = 600) -> int:
    """Run torchrun in its own session; on a timeout end the whole group (its workers too:
    killing torchrun alone leaves them waiting on each other)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode:
        print(err[-6000:])
    return proc.returncode


@pytest.fixture(scope="module")
def single() -> dict:
    return proof.reference()


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(runs, single, name):
    record = json.loads((runs / f"{name}.json").read_text())
    assert record["losses"] == pytest.approx(single["losses"], rel=1e-5), record["layout"]
    assert record["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    weights = torch.load(runs / f"{name}.weights.pt")
    assert weights.keys() == single["weights"].keys()
    for key, expected in single["weights"].items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=2e-4, msg=key)
    # The run really trained: the weights moved further than the tolerance.
    assert any(
        float((weights[k] - v).abs().max()) > 1e-2
        for k, v in proof.build_model().state_dict().items()
    )


KIND = {"tp": "tensor", "cp": "context", "pp": "pipeline", "dp": "data", "dp_cp": "data"}


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.startswith("resume:")])
def test_planner_predicts_the_bytes_each_layout_sent(runs, name):
    """trainer/sizing/comm.py against the bytes rank 0 put on the wire in one step (counted
    by trainer/parallel/wire.py): the same within 1% for each kind of parallelism."""
    record = json.loads((runs / f"{name}.json").read_text())
    lay = proof.parse(name, 4)
    m = proof.model_config()
    shape = comm.ModelShape(m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, proof.VOCAB)
    step = comm.Step(proof.SEQ, proof.ROWS // lay.dp, proof.GRAD_ACCUM, activation_bytes=4)
    predicted = dataclasses.asdict(comm.comm_bytes(shape, step, lay))
    if lay.dp == 1 and lay.cp > 1:  # the gradient's replicas are the context group itself
        predicted["context"] += predicted.pop("data")
        predicted["data"] = 0.0
    counted = dict.fromkeys(predicted, 0.0)
    for dim, sent in record["wire_bytes"].items():
        counted[KIND[dim]] += sent
    assert counted == pytest.approx(predicted, rel=0.01), lay.describe()
    assert sum(counted.values()) > 0
