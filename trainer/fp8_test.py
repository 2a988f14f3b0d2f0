"""fp8 training's numerics on the CPU (no fp8 hardware here): the scales, the float8 matmul
against bf16 and fp32 within stated tolerances, the emulated path against `torch._scaled_mm`
(CPU torch has a reference implementation, so the operand layouts and scales the GPU path
passes are checked), which modules the swap touches, a short real training run, and the
refusals. The speed of fp8 needs a GPU: tools/gpu/verify.sh measures it."""

import pytest
import torch
from torch import nn

from protos.config_yaml import ConfigError, job_spec_from_dict
from protos.progress_log import read_progress_log
from protos.validation import resolve_trainer
from trainer import fp8, loop
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.model import Transformer
from trainer.recipes.lm import lm_trainer
from trainer.testing import tiny_job

torch.set_num_threads(1)
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
E4M3, E5M2 = fp8.Float8Format.E4M3, fp8.Float8Format.E5M2

# Relative L2 error of the fp8 matmul against fp32, for Gaussian operands (measured here:
# 3.7% forward, 5.9% for both gradients; bf16 is at 0.3%). e4m3 keeps 3 mantissa bits (2^-4
# relative rounding per element), e5m2 2 bits: the gradients, one e5m2 operand, err more.
FORWARD_TOLERANCE = 0.05  # y = x @ w.T, both operands e4m3
BACKWARD_TOLERANCE = 0.08  # grad_x and grad_w: one operand e5m2, one e4m3
# The emulated path against torch._scaled_mm on the same float8 operands, fp32 out: only the
# order of the fp32 sums differs (measured: ~1.5e-7).
EMULATION_TOLERANCE = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_tensorwise_scales_put_amax_on_the_formats_largest_value():
    x = torch.randn(64, 32) * 3.0
    x[5, 7] = -40.0  # the amax, negative
    for fmt, largest in ((E4M3, 448.0), (E5M2, 57344.0)):
        data, scale = fp8.to_float8(x, fmt)
        assert data.dtype == fmt.value and scale.dtype == torch.float32 and scale.numel() == 1
        assert scale.item() == pytest.approx(largest / 40.0)
        assert data.float().abs().max().item() == largest
        assert data[5, 7].item() == -largest
        assert rel(data.float() / scale, x) < (0.04 if fmt is E4M3 else 0.08)
    zeros, scale = fp8.to_float8(torch.zeros(4, 4), E4M3)
    assert torch.isfinite(scale) and not zeros.float().any()


def _fp8_and_reference(backend: fp8.Backend, seed=0, M=250, K=128, N=96):
    torch.manual_seed(seed)
    x = torch.randn(M, K)
    linear = nn.Linear(K, N, bias=False)
    grad_y = torch.randn(M, N)
    results = {}
    for name, layer, dtype in (
        ("fp8", fp8.Float8Linear.from_linear(linear, backend), torch.float32),
        ("bf16", linear, torch.bfloat16),
        ("fp32", linear, torch.float32),
    ):
        xi = x.to(dtype).detach().requires_grad_()
        linear.weight.grad = None
        if name == "bf16":  # the matmul in bf16, fp32 master weight (what autocast does)
            y = xi @ linear.weight.to(torch.bfloat16).t()
        else:
            y = layer(xi)
        y.backward(grad_y.to(y.dtype))
        results[name] = (y.detach().float(), xi.grad.float(), linear.weight.grad.clone())
    return results


def test_float8_linear_is_close_to_bf16_and_fp32_forward_and_backward():
    r = _fp8_and_reference(fp8.Backend.EMULATED)
    (y, gx, gw), (y16, gx16, gw16), (y32, gx32, gw32) = r["fp8"], r["bf16"], r["fp32"]
    assert rel(y, y32) < FORWARD_TOLERANCE and rel(y, y16) < FORWARD_TOLERANCE
    assert rel(gx, gx32) < BACKWARD_TOLERANCE and rel(gw, gw32) < BACKWARD_TOLERANCE
    assert rel(gx, gx16) < BACKWARD_TOLERANCE and rel(gw, gw16) < BACKWARD_TOLERANCE
    assert gw.dtype == torch.float32  # the master weight's gradient stays fp32
    # ...and fp8 is really quantizing: further from fp32 than bf16 is.
    assert rel(y, y32) > 2 * rel(y16, y32)


def test_emulation_matches_torch_scaled_mm_on_the_same_float8_operands():
    """The SCALED_MM path (row-/column-major operands, reciprocal scales, the token count 250
    padded to a multiple of 16 for grad_w) against the plain quantize-dequantize matmul,
    through torch's CPU reference of _scaled_mm."""
    emulated = _fp8_and_reference(fp8.Backend.EMULATED, seed=1)["fp8"]
    real = _fp8_and_reference(fp8.Backend.SCALED_MM, seed=1)["fp8"]
    for a, b in zip(real, emulated, strict=True):
        assert rel(a, b) < EMULATION_TOLERANCE


def test_autocast_sets_the_output_dtype_and_the_bias_is_added():
    linear = nn.Linear(32, 16)
    layer = fp8.Float8Linear.from_linear(linear, fp8.Backend.EMULATED)
    x = torch.randn(2, 5, 32)
    assert layer(x).shape == (2, 5, 16) and layer(x).dtype == torch.float32
    assert rel(layer(x), linear(x)) < FORWARD_TOLERANCE
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16


def test_the_swap_takes_the_blocks_linears_only_and_keeps_the_parameters(tmp_path):
    spec = job_spec_from_dict(tiny_job(tmp_path))
    cfg = resolve_trainer(spec.trainer).model
    model = Transformer(cfg, vocab_size=512)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    swapped = fp8.convert(model, fp8.Backend.EMULATED)
    per_block = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    per_block += ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert sorted(swapped) == sorted(
        f"layers.{i}.{name}" for i in range(cfg.n_layers) for name in per_block
    )
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding
    assert list(model.state_dict()) == keys  # checkpoints load either way
    after = dict(model.named_parameters())
    assert all(after[n] is p for n, p in before.items())  # the optimizer's tensors, not copies
    odd = nn.Sequential(nn.Linear(64, 24), nn.Linear(24, 64))  # 24 is not a multiple of 16
    assert fp8.convert(odd, fp8.Backend.EMULATED) == []


def fp8_trainer(cache, run_dir, dtype: str) -> loop.Trainer:
    spec = job_spec_from_dict(tiny_job(cache, steps=12, train={"dtype": dtype}))
    cfg = resolve_trainer(spec.trainer)
    ds = precook_dataset(cfg.data, str(cache), show_progress=False)
    return lm_trainer(cfg, run_dir, CPU, ds.path, ds.tokenizer.vocab_size, log=lambda _: None)


def test_a_short_run_with_float8_linears_tracks_bf16(tmp_path, monkeypatch):
    """The real trainer with dtype fp8; only the device check is replaced (this CPU has no fp8
    matmuls, so the emulated backend stands in for _scaled_mm)."""
    monkeypatch.setattr(fp8, "backend_for", lambda device: fp8.Backend.EMULATED)
    losses = {}
    for dtype in ("bf16", "fp8"):
        run_dir = tmp_path / dtype
        trainer = fp8_trainer(tmp_path / "cache", run_dir, dtype)
        assert trainer.dtype == torch.bfloat16  # fp8 runs inside bf16 autocast
        n = sum(isinstance(m, fp8.Float8Linear) for m in trainer.model.modules())
        assert n == (14 if dtype == "fp8" else 0)
        assert trainer.run() == loop.Outcome.DONE
        losses[dtype] = [r.loss for r in read_progress_log(run_dir).records if r.phase == "train"]
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.5, losses
    gap = max(abs(a - b) for a, b in zip(losses["fp8"], losses["bf16"], strict=True))
    assert gap < 0.1, losses  # nats, over 12 steps of the tiny model


def test_fp8_is_refused_without_fp8_matmuls_naming_the_field(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="trainer.train.dtype.*on cpu"):
        fp8_trainer(tmp_path / "cache", tmp_path / "run", "fp8")
    # An A100 (8.0): faked, no GPU here; the check reads only the capability and the name.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"trainer.train.dtype.*A100 is 8\.0"):
        fp8.backend_for(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.backend_for(torch.device("cuda")) is fp8.Backend.SCALED_MM
