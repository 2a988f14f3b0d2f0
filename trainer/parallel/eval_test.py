"""Held-out eval under every layout equals one process scoring the same rows.

A torchrun launch of 2 gloo processes (and one of 4 for the products with data parallel) sets
up the tiny model under each layout of eval_proof.py (the trainer's own set-up and
trainer/evaluate.py) and scores the eval split of a small real corpus; this process scores,
alone, the rows the layout's data-parallel ranks read (EVAL_BATCHES batches for each). The
token counts must be equal, the losses equal to float summation order, on every rank. (Before
the fix tensor parallel read rows by the global rank and summed over its peers: twice the
tokens, and another loss; pipeline and context parallel were not evaluated at all.)
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.parallel import eval_proof

torch.set_num_threads(1)
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
NAMES = tuple(eval_proof.LAYOUTS)
WORLDS = sorted({world for world, _, _ in eval_proof.LAYOUTS.values()})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, str]:
    cache = str(tmp_path_factory.mktemp("cache"))
    cfg = eval_proof.config(cache, "tp2", 1)
    return cache, precook_dataset(cfg.data, cache, show_progress=False).path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset) -> dict:
    """Every rank's result of every layout: one torchrun launch per number of processes."""
    out = tmp_path_factory.mktemp("eval")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for world in WORLDS:
        names = [n for n in NAMES if eval_proof.LAYOUTS[n][0] == world]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", str(world), "-m", "trainer.parallel.eval_proof", str(out)]
        proc = subprocess.run(
            [*cmd, *dataset, *names], env=env, capture_output=True, text=True, timeout=400
        )
        assert proc.returncode == 0, proc.stderr[-6000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_heldout_loss_of_layout_equals_one_process(runs, dataset, name):
    cache, path = dataset
    single = eval_proof.score(eval_proof.config(cache, name, 1), CPU, path)
    assert single is not None and single.tokens > 0
    expected = {
        "loss": pytest.approx(single.loss, rel=1e-5),
        "perplexity": pytest.approx(single.perplexity, rel=1e-5),
        "tokens": single.tokens,
    }
    for rank, got in enumerate(runs[name]):
        assert got == expected, (name, rank)
