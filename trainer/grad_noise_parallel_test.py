"""The gradient noise scale under FSDP2 is the one DDP measures, on the same data.

Two processes under torchrun (gloo on 127.0.0.1), two micro-batches each per step: the same
global batches (the loader hands batch g to rank g % world), the same per-rank micro-batch
norm (grad_noise.MicroBatchGradNorm: hooks on the leaves of the loss's graph, under FSDP2 the
unsharded parameters, as autograd produces their gradients) and the same whole-step norm
(under FSDP2 the DTensor norm of the gradient shards). So every step's B_simple must agree up
to float summation order.

Tolerance: relative 1e-4. They agree to 1e-6 here (2026-12-01: 2874.574 and 2874.570 tokens
at step 1). The losses agree to ~1e-6 (distributed_test.py), and B_simple divides two
differences of nearly equal squared norms (McCandlish appendix A.1), which multiplies their
relative error by |G_B|²/|G|²: 1e-4 leaves room for that, while a wrong norm (a shard's instead
of the whole, the reduced gradient instead of a rank's, a missing rescale) moves the estimate
by a factor of 2 or more.
"""

import pytest

from protos.progress_log import read_progress_log
from trainer.testing import tiny_job, torchrun, write_job

STEPS = 2


def noise_scales(root, parallelism: str) -> dict[int, float]:
    job = write_job(
        root / f"{parallelism}.yaml",
        tiny_job(
            root / "cache",
            steps=STEPS,
            train={"parallelism": parallelism, "grad_accum": 2},
            checkpoint={"every_steps": 0},
        ),
    )
    result = torchrun(job, root / parallelism)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in read_progress_log(root / parallelism).records if r.phase == "train"]
    return {r.step: r.gradient_noise_scale for r in records}


def test_fsdp_measures_the_noise_scale_ddp_measures(tmp_path):
    ddp = noise_scales(tmp_path, "DDP")
    fsdp = noise_scales(tmp_path, "FSDP")
    assert sorted(ddp) == sorted(fsdp) == list(range(1, STEPS + 1))
    assert all(value != 0 for value in fsdp.values())  # measured at every step
    for step in ddp:
        gap = abs(fsdp[step] / ddp[step] - 1)
        print(f"step {step}: B_simple DDP {ddp[step]:.7g}, FSDP {fsdp[step]:.7g} ({gap:.1e})")
        assert fsdp[step] == pytest.approx(ddp[step], rel=1e-4), step
