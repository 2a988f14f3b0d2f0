"""A tiny Llama-style model trained a few steps with the kernels and with the references: the
losses must match step by step. Built here from the ops (not the trainer), so it checks exactly
the kernels: forward, every backward, and their use together under an optimizer."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import kernels
from kernels import reference
from kernels.modules import RotaryEmbedding
from kernels.testing import assert_close, require_triton

require_triton()

VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 64, 32, 4, 2, 48, 2
HEAD_DIM = DIM // HEADS
BATCH, SEQ, STEPS = 2, 16, 6


class Block(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops
        self.attn_norm = nn.Parameter(torch.ones(DIM))
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(DIM))
        self.gate_up = nn.Linear(DIM, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.ops.rms_norm(x, self.attn_norm)
        q = self.q(h).view(b, s, HEADS, HEAD_DIM)
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, HEAD_DIM).unbind(dim=2)
        q, k = self.ops.apply_rope(q, k, cos, sin)
        repeat = HEADS // KV_HEADS
        k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, DIM))
        gate, up = self.gate_up(self.ops.rms_norm(x, self.mlp_norm)).chunk(2, dim=-1)
        return x + self.down(self.ops.swiglu(gate, up))


class TinyLM(nn.Module):
    def __init__(self, ops, fused_loss: bool):
        super().__init__()
        self.ops, self.fused_loss = ops, fused_loss
        self.embed = nn.Embedding(VOCAB, DIM)
        self.rope = RotaryEmbedding(HEAD_DIM, max_len=SEQ)
        self.blocks = nn.ModuleList(Block(ops) for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.ones(DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, position_ids, labels):
        x = self.embed(input_ids)
        cos, sin = self.rope.cos_sin(position_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.ops.rms_norm(x, self.norm)
        if self.fused_loss:
            return self.ops.fused_linear_cross_entropy(x, self.head.weight, labels)
        return self.ops.cross_entropy(self.head(x), labels)


def _batch():
    # Two packed documents per row of a counting sequence: positions restart, the last token
    # of each document has no target.
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    input_ids = (starts + torch.arange(SEQ)) % VOCAB
    labels = (input_ids + 1) % VOCAB
    half = SEQ // 2
    position_ids = torch.arange(SEQ).repeat(BATCH, 1) % half
    labels[:, half - 1] = -100
    labels[:, -1] = -100
    return input_ids, position_ids, labels


def _train(ops, fused_loss: bool) -> list[float]:
    torch.manual_seed(0)
    model = TinyLM(ops, fused_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = model(*_batch())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fused_loss", [True, False], ids=["fused_linear_ce", "cross_entropy"])
def test_kernels_and_reference_train_the_same(fused_loss):
    with_kernels = _train(kernels, fused_loss)
    with_reference = _train(reference, fused_loss)
    assert with_kernels == pytest.approx(with_reference, rel=1e-4), (with_kernels, with_reference)
    assert with_kernels[-1] < with_kernels[0] - 0.5, f"the model did not learn: {with_kernels}"


def test_activation_checkpointing_recomputes_the_same_gradients():
    # Non-reentrant checkpointing reruns each op's forward during backward (as the trainer's
    # recompute option does): the kernels' saved state must survive that.
    torch.manual_seed(1)
    block = Block(kernels)
    x = torch.randn(BATCH, SEQ, DIM)
    cos, sin = RotaryEmbedding(HEAD_DIM, max_len=SEQ).cos_sin(_batch()[1])
    grads = []
    for recompute in (False, True):
        block.zero_grad()
        out = (
            checkpoint(block, x, cos, sin, use_reentrant=False) if recompute else block(x, cos, sin)
        )
        out.square().mean().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        assert_close(recomputed, plain, torch.float32)
