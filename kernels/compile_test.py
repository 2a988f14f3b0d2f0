"""Every op inside a torch.compile'd model: one graph (fullgraph), same loss and gradients as
eager, and the Triton kernels (as torch.library custom ops) in both compiled graphs.

Dynamo cannot trace a Triton launch in the interpreter (it reads raw storage pointers), so the
ops reach compiled graphs as opaque custom ops; see kernels/ops/utils.py:compile_safe.
"""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import kernels
from kernels import reference
from kernels.testing import assert_close, require_triton

require_triton()

TOKENS, DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 12, 16, 2, 1, 8, 24, 40


class AllOps(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops
        self.norm = nn.Parameter(torch.ones(DIM))
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.gate_up = nn.Linear(DIM + HEADS * HEAD_DIM + KV_HEADS * HEAD_DIM, 2 * HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x, cos, sin, target):
        h = self.ops.rms_norm(x, self.norm)
        tokens = x.shape[0]  # symbolic under dynamic shapes
        q = self.q(h).view(1, tokens, HEADS, HEAD_DIM)
        k = self.k(h).view(1, tokens, KV_HEADS, HEAD_DIM)
        q, k = self.ops.apply_rope(q, k, cos, sin)
        mixed = torch.cat((h, q.reshape(tokens, -1), k.reshape(tokens, -1)), dim=-1)
        gate, up = self.gate_up(mixed).chunk(2, dim=-1)
        h = h + self.down(self.ops.swiglu(gate, up))
        fused = self.ops.fused_linear_cross_entropy(h, self.head.weight, target)
        per_token = self.ops.cross_entropy(self.head(h), target, reduction="none")
        weighted = self.ops.fused_linear_cross_entropy(
            h, self.head.weight, target, reduction="none"
        )
        return fused + (per_token + weighted * torch.linspace(0, 1, tokens)).mean()


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(TOKENS, DIM)
    angles = torch.randn(1, TOKENS, HEAD_DIM)
    target = torch.randint(0, VOCAB, (TOKENS,))
    target[3] = -100
    return x, angles.cos(), angles.sin(), target


def _loss_and_grads(model, fn):
    model.zero_grad()
    loss = fn(*_inputs())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _graph_ops(graphs):
    return {
        str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"
    }


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic_shapes"])
def test_compiled_model_matches_eager_and_calls_the_kernels(dynamic):
    torch.manual_seed(1)
    model = AllOps(kernels)
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(
        model,
        backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
        fullgraph=True,
        dynamic=dynamic,
    )
    loss, grads = _loss_and_grads(model, compiled)
    eager_loss, eager_grads = _loss_and_grads(model, model)
    reference_model = AllOps(reference)
    reference_model.load_state_dict(model.state_dict())
    ref_loss, ref_grads = _loss_and_grads(reference_model, reference_model)
    for got, want in ((loss, eager_loss), (loss, ref_loss)):
        assert_close(got, want, torch.float32)
    for got, eager, ref in zip(grads, eager_grads, ref_grads, strict=True):
        assert_close(got, eager, torch.float32)
        assert_close(got, ref, torch.float32)

    assert len(graphs) == 2, "one forward and one backward graph: no graph breaks"
    inputs = [n.meta.get("val") for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert any(isinstance(v, torch.SymInt) for v in inputs) == dynamic, "symbolic token count"
    called = _graph_ops(graphs)
    for op in (
        "kernels.rms_norm_forward.default",
        "kernels.rms_norm_backward.default",
        "kernels.rope_forward.default",
        "kernels.rope_backward.default",
        "kernels.swiglu_forward.default",
        "kernels.swiglu_backward.default",
        "kernels.cross_entropy_forward.default",
        "kernels.fused_linear_cross_entropy_forward.default",
        "kernels.fused_linear_cross_entropy_backward_none.default",
        "kernels.scale_rows.default",
    ):
        assert op in called, f"{op} missing from the compiled graphs: {sorted(called)}"


def test_inductor_compiles_and_runs_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(2)
    model = AllOps(kernels)
    compiled = torch.compile(model, fullgraph=True)
    loss, grads = _loss_and_grads(model, compiled)
    eager_loss, eager_grads = _loss_and_grads(model, model)
    assert_close(loss, eager_loss, torch.float32)
    for got, want in zip(grads, eager_grads, strict=True):
        assert_close(got, want, torch.float32)


def test_one_tensor_passed_to_two_inputs():
    # Dynamo refuses autograd.Function.apply with a repeated input; the ops pass a view instead.
    def step(h, q, k, cos):
        q, k = kernels.apply_rope(q, k, cos, cos)
        return kernels.swiglu(h, h).sum() + q.sum() + k.sum()

    torch.manual_seed(3)
    args = [
        torch.randn(3, 5),
        torch.randn(1, 3, 2, 4),
        torch.randn(1, 3, 1, 4),
        torch.randn(1, 3, 4),
    ]
    leaves = [a.requires_grad_() for a in args[:3]]
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*args), leaves)
    want = torch.autograd.grad(step(*args), leaves)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, torch.float32)
