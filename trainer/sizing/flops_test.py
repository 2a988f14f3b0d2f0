import math

import pytest
import torch

from trainer.sizing import flops
from trainer.sizing.accelerators import ACCELERATORS, match_accelerator


def test_flops_per_token_by_hand():
    # Llama-2-7B: d=4096, 32 layers, 32 heads of 128, FFN 11008, vocab 32000, untied.
    # Non-embedding: 32·(4·4096² + 3·4096·11008 + 2·4096) + 32000·4096 (the output head).
    n = 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 32000 * 4096
    assert n == 6_607_339_520
    # 6N = 39,644,037,120; 12·32·32·128·4096 = 6,442,450,944.
    assert flops.flops_per_token(n, 32, 32, 128, 4096) == 39_644_037_120 + 6_442_450_944


def test_reproduces_palm_540b_reported_mfu():
    # PaLM (Chowdhery et al. 2022): 540.35B parameters (input and output embeddings tied, so
    # every parameter is used once as a matmul weight), L=118, H=48, Q=256, T=2048; 238.3K
    # tokens/s on 6144 TPU v4 chips of 275 TFLOP/s bf16 peak; reported MFU 46.2%.
    f = flops.flops_per_token(540.35e9, 118, 48, 256, 2048)
    assert flops.mfu(238.3e3, f, 6144 * 275e12) == pytest.approx(0.462, abs=5e-4)


def test_mfu_and_achieved():
    assert flops.achieved_flops_per_second(1000.0, 6e9) == 6e12
    assert flops.mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak"):
        flops.mfu(1.0, 1.0, 0.0)


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200-NVL"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("h100-sxm", "H100-SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA B200", "B200"),
        ("AMD Instinct MI300X", "MI300X"),
        ("AMD Instinct MI300X VF", "MI300X"),
    ],
)
def test_table_matching(name, key):
    found, itself = match_accelerator(name), match_accelerator(key)
    assert found is not None and found.key == key
    # Every key is itself a name that matches its own entry.
    assert itself is not None and itself.key == key


@pytest.mark.parametrize(
    "name", ["NVIDIA GH200 480GB", "NVIDIA GB200", "AMD Instinct MI300A", "Tesla V100", "cpu"]
)
def test_unknown_devices_match_nothing(name):
    assert match_accelerator(name) is None


def test_table_values():
    expected = {"A100-80GB": 312e12, "H100-SXM": 989e12, "H200": 989e12, "B200": 2.25e15}
    for key, peak in expected.items():
        assert ACCELERATORS[key].bf16_dense_flops == peak
    assert ACCELERATORS["MI300X"].bf16_dense_flops == 1.3e15


def test_cpu_peak_is_measured_and_cached():
    torch.set_num_threads(1)
    peak, basis = flops.peak_flops_per_second("cpu", torch.float32)
    assert basis == "measured"
    assert math.isfinite(peak) and 1e8 < peak < 1e14
    # Cached: the second call returns the same number without re-measuring.
    assert flops.peak_flops_per_second(torch.device("cpu"), "fp32") == (peak, "measured")


def test_bad_dtype_names_the_argument():
    with pytest.raises(ValueError, match="dtype"):
        flops.peak_flops_per_second("cpu", "int8")
