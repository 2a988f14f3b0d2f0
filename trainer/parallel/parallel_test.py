"""Every layout equals one process: the same losses, gradient norms and final weights.

One torchrun launch of 4 gloo processes trains the tiny model of proof.py under each layout
(3 steps, 2 micro-batches of 4 packed rows), and a run that changes layout through a
distributed checkpoint; this process trains it alone, the trainer's way, and compares.
Tolerances in proving.py. FSDP composes with TP, PP and CP here; layout3d_test.py runs the
3-D layouts on 8 processes.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from trainer.parallel import proof, proving
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
    "fsdp2,tp2",  # FSDP composed with tensor parallel (2-D, torchtitan's)
    "pp2:ONE_F_ONE_B,fsdp2",  # FSDP per pipeline stage
    "cp2,fsdp2",
    "plain:fsdp4",  # trainer/distributed.py's FSDP, micro-batches run as trainer/loop.py does
    "resume:tp2>dp4",  # two steps under TP, the third under plain data parallel
    "resume:cp2,tp2>pp2:GPIPE",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("proof")
    proving.launch(out, LAYOUTS, nproc=4)
    return out


@pytest.fixture(scope="module")
def single() -> dict:
    return proof.reference()


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(runs, single, name):
    proving.assert_matches_one_process(runs, name, single)


KIND = {"tp": "tensor", "cp": "context", "pp": "pipeline", "dp": "data", "dp_cp": "data"}


PRICED = [n for n in LAYOUTS if not n.startswith("resume:")]


@pytest.mark.parametrize("name", PRICED)
def test_planner_predicts_the_bytes_each_layout_sent(runs, name):
    """trainer/sizing/comm.py against the bytes rank 0 put on the wire in one step (counted
    by trainer/parallel/wire.py): the same within 1% for each kind of parallelism."""
    record = json.loads((runs / f"{name}.json").read_text())
    lay = proof.parse(name.removeprefix("plain:"), 4)
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
