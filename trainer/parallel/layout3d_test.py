"""3-D layouts equal one process: 8 gloo processes, one torchrun launch, proof.py's tiny model
(3 steps, 2 micro-batches of 4 packed rows; each data-parallel rank takes 2 rows).

  pp2 x dp2 x tp2                      pipeline, replicated data, tensor parallel
  pp2 (interleaved) x fsdp2 x tp2+sp   torchtitan's composition: FSDP over TP-split blocks,
                                        per pipeline stage, with sequence parallel

Tolerances as every layout's (proving.py). Measured: 41-95 s on 2 cores at load average
7-24 (8 processes; the larger share is starting them).
"""

from pathlib import Path

import pytest

from trainer.parallel import proof, proving

LAYOUTS = ("pp2:ONE_F_ONE_B,tp2", "pp2:INTERLEAVED_1F1B,fsdp2,tp2+sp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("proof3d")
    proving.launch(out, LAYOUTS, nproc=8)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_3d_layout_matches_one_process(runs, name):
    proving.assert_matches_one_process(runs, name, proof.reference())
    lay = proof.parse(name, 8)
    assert (lay.pp, lay.dp, lay.tp) == (2, 2, 2)
