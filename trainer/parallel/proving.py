"""What the proof tests share: one torchrun launch of proof.py, and the comparison of a
layout's record with the single process (proof.reference()).

Tolerances (fp32): losses and norms relative 1e-5, weights absolute 2e-4 (AdamW divides by
the root of the second moment, so a weight with a near-zero gradient amplifies the last-bit
differences of a sum taken in another order; measured: at most ~7e-5).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.parallel import proof


def launch(out: Path, names: tuple[str, ...], nproc: int, timeout: float = 600) -> None:
    """proof.py under torchrun, in its own session; on a timeout end the whole group (its
    workers too: killing torchrun alone leaves them waiting on each other)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--standalone", "-m", "trainer.parallel.proof", str(out), *names]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert proc.returncode == 0, err[-6000:]


def assert_matches_one_process(out: Path, name: str, single: dict) -> None:
    """Layout `name`'s run gave the single process's losses, norms and final weights, and
    really trained (its weights moved further than the tolerance)."""
    record = json.loads((out / f"{name}.json").read_text())
    assert record["losses"] == pytest.approx(single["losses"], rel=1e-5), record["layout"]
    assert record["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    weights = torch.load(out / f"{name}.weights.pt")
    assert weights.keys() == single["weights"].keys()
    for key, expected in single["weights"].items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=2e-4, msg=key)
    assert any(
        float((weights[k] - v).abs().max()) > 1e-2
        for k, v in proof.build_model().state_dict().items()
    )
