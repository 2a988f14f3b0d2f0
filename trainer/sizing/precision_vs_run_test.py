"""The plan's memory per precision against what a real tiny model holds on this CPU.

Kitchen's tiny config (protos/defaults.py) cut to 2 layers and micro batch 2 × 128 tokens, in
fp32 and in bf16 autocast (the CUDA default; on this CPU it is slow, so only the forward pass
runs under it). Measured, in a fresh process:

- model states, from the tensors: the parameters' bytes, the gradients' after a backward pass,
  AdamW's state after a step (AdamW is the trainer's, trainer/optim.py), and under autocast the
  16-bit copies of the weights it makes (a TorchDispatchMode sees each cast of a parameter);
- activations saved for backward, per layer: a torch.autograd.graph.saved_tensors_hooks pack
  hook sees every tensor autograd keeps; each storage counts once, for the block whose forward
  first saved it, leaving out the parameters and their autocast copies (model states above).

The activations run Kitchen's own kernels (kernels/, the Triton ops the trainer uses on a GPU,
here in Triton's interpreter), because what a layer keeps depends on them: the fused SwiGLU
keeps gate and up and recomputes silu; the reference ops keep fp32 intermediates instead.

Exact: parameters, gradients and AdamW state. The autocast copies are the plan's 2 bytes per
parameter less the norm weights, which autocast does not cast (norms run in fp32). Activations:
measured / plan in [1.00, 1.06]: on this masked path SDPA also keeps a 16- or 32-bit copy of
the boolean document mask (b·s²·e per layer, 3% here; the GPU's variable-length path has none)
and its logsumexp (4·a·s·b), which the plan leaves out; the first layer also holds the rotary
cos and sin tables every layer reads (2 · b·s·Q fp32, 2% here). The tiny model runs grouped-
query attention (4 KV heads of 8) so that the plan's kv_heads term meets a real one.
"""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from trainer.lm_loss import summed_loss

LAYERS, SEQ_LEN, MICRO_BATCH, KV_HEADS = 2, 128, 2, 4
PRECISIONS = {"fp32": None, "bf16": "bfloat16"}


def tiny_config():
    from protos import trainer_config_pb2
    from protos.validation import resolve_trainer

    cfg = resolve_trainer(trainer_config_pb2.TrainerConfig())
    cfg.model.n_layers, cfg.data.seq_len, cfg.train.micro_batch = LAYERS, SEQ_LEN, MICRO_BATCH
    cfg.model.n_kv_heads = KV_HEADS
    return cfg


def planned(precision: str) -> dict:
    """`plan --json` for the tiny shape on this CPU, in `precision`."""
    from trainer.sizing import plan

    m, data = tiny_config().model, tiny_config().data
    argv = ["--layers", m.n_layers, "--dim", m.dim, "--heads", m.n_heads]
    argv += ["--kv-heads", m.n_kv_heads, "--ffn-dim", m.ffn_dim, "--vocab", data.vocab_size]
    argv += ["--seq-len", SEQ_LEN, "--micro-batch", MICRO_BATCH, "--gpu", "cpu", "--gpus", 1]
    argv += ["--tokens", "1M", "--dtype", precision, "--attention", "flash", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan.main([str(x) for x in argv])
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def measured():
    """Bytes per precision, measured in one fresh process with the Triton interpreter on."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "trainer.sizing.precision_vs_run_test", *PRECISIONS],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_model_states(measured, precision):
    run, plan = measured[precision], planned(precision)["memory"]
    states = plan["model_states"]["ddp"]  # one GPU: nothing sharded
    if precision == "fp32":  # the parameters are the weights the matmuls read
        assert run["parameters"] == states["weights"]["value"]
        assert states["master"]["value"] == run["weight_casts"] == 0
    else:  # the parameters are the master copy; the matmuls read autocast's bf16 copies
        assert run["parameters"] == states["master"]["value"]
        norms = 2 * run["norm_params"]  # not cast: norms run in fp32
        assert run["weight_casts"] == states["weights"]["value"] - norms
    assert run["gradients"] == states["gradients"]["value"]
    assert run["adamw_state"] == states["optimizer"]["value"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_activations_saved_per_layer(measured, precision):
    per_layer, plan = measured[precision]["saved_per_layer"], planned(precision)["memory"]
    predicted = plan["activations_per_layer"]["none"]["value"]
    assert len(per_layer) == LAYERS
    for layer, saved in enumerate(per_layer):
        print(f"{precision} layer {layer}: plan {predicted:,.0f} B, saved {saved:,} B")
        assert 1.0 <= saved / predicted <= 1.06, (layer, saved, predicted)


def test_autocast_halves_what_the_matmuls_keep(measured):
    # Not a tautology of the above: bf16 keeps the residual in fp32 and a cast per
    # projection, so it saves well over half of fp32's; the plan must say the same ratio.
    bf16, fp32 = planned("bf16")["memory"], planned("fp32")["memory"]
    plan_ratio = (
        bf16["activations_per_layer"]["none"]["value"]
        / fp32["activations_per_layer"]["none"]["value"]
    )
    run_ratio = measured["bf16"]["saved_per_layer"][0] / measured["fp32"]["saved_per_layer"][0]
    assert 0.5 < plan_ratio < 1
    assert run_ratio == pytest.approx(plan_ratio, rel=0.03)


def measure(precision: str) -> dict:
    """Model-state and saved-activation bytes of the tiny model in `precision`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import kernels
    from kernels import reference
    from trainer.model import Transformer
    from trainer.optim import build_optimizer
    from trainer.sizing.tiny_batch import tiny_batch

    torch.set_num_threads(1)
    cfg = tiny_config()
    name = PRECISIONS[precision]
    dtype = getattr(torch, name) if name else None

    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    class ParameterCasts(TorchDispatchMode):
        """The storages autocast creates by casting a parameter (its cached weight copies)."""

        def __init__(self, params: set[int]):
            super().__init__()
            self.params = params
            self.casts: dict[int, int] = {}  # storage -> bytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and storage(args[0]) in self.params:
                self.casts[storage(out)] = out.untyped_storage().nbytes()
            return out

    # Model states: the reference ops (states do not depend on the kernels), one step.
    model = Transformer(cfg.model, cfg.data.vocab_size, ops=reference)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    ids, position_ids, layout, labels = tiny_batch(cfg)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = summed_loss(model, ids, position_ids, layout, labels)
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    result = {
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params),
        "adamw_state": sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for name, t in state.items()
            if name in ("exp_avg", "exp_avg_sq")
        ),
        "norm_params": sum(
            p.numel() for name, p in model.named_parameters() if name.endswith("norm.weight")
        ),
    }

    # Activations: Kitchen's kernels, forward only (what is saved is known once it ran).
    model = Transformer(cfg.model, cfg.data.vocab_size, ops=kernels)
    param_storages = {storage(p) for p in model.parameters()}
    casts = ParameterCasts(param_storages)
    current: list[int | None] = [None]
    seen: set[int] = set()
    per_layer = [0] * len(model.layers)
    saved: list[torch.Tensor] = []  # alive until counted: a freed storage's address recurs

    def enter(i: int):
        return lambda module, args: current.__setitem__(0, i)

    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(enter(i))
        block.register_forward_hook(lambda module, args, out: current.__setitem__(0, None))

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        key = storage(t)
        # The autocast weight copies are model states ("weight_casts"), not activations.
        model_state = key in param_storages or key in casts.casts
        if current[0] is not None and key not in seen and not model_state:
            seen.add(key)
            per_layer[current[0]] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), casts:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            summed_loss(model, ids, position_ids, layout, labels)
    result["weight_casts"] = sum(casts.casts.values())
    result["saved_per_layer"] = per_layer
    return result


if __name__ == "__main__":
    print(json.dumps({p: measure(p) for p in sys.argv[1:]}))
