"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

Rows come packed from precook: several documents per row, positions restarting at each
document. Attention never crosses a document boundary: a block-diagonal causal mask built from
`document_ids`, or on CUDA in bf16 the variable-length flash path, which skips the masked
blocks instead of computing and discarding them.

The norms, the MLP and the rotary tables are `kernels.modules`' layers; they go through `ops`:
the `kernels` package (fused Triton) where it runs, else `kernels.reference` (plain PyTorch,
same signatures). The model knows no loss: `forward` hands its final hidden states to the
caller's `head` (a recipe's loss, trainer/lm_loss.py for language modelling).
"""

import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import kernels
from kernels import reference
from kernels.modules import RMSNorm, RotaryEmbedding
from protos.defaults import head_dim
from trainer import moe


def select_ops(use_kernels: bool, device):
    """`kernels` when asked for and Triton runs on `device`, else the PyTorch reference."""
    return kernels if use_kernels and kernels.triton_available(device) else reference


class Layout(NamedTuple):
    """Who attends to whom in a batch. All None: plain causal attention over each row."""

    mask: torch.Tensor | None = None  # (B, 1, T, T) bool, True = may attend
    cu_seqlens: torch.Tensor | None = None  # (segments + 1,) int32 offsets into B*T tokens
    max_len: int = 0  # longest segment, for the variable-length kernel


@functools.cache
def varlen_attn():
    """torch's variable-length flash attention, or None (torch < 2.9). Imported on first use:
    the import pulls in torch._dynamo, seconds of start-up a CPU run does not need."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def attention_layout(document_ids: torch.Tensor, device, dtype) -> Layout:
    """The Layout for a batch of packed rows; `document_ids` (B, T) are still on the CPU.

    Padding (-1) forms its own segment: it attends only to padding and carries no loss.
    """
    doc = document_ids
    if bool((doc == doc[:, :1]).all()) and bool((doc[:, 0] >= 0).all()):
        return Layout()  # one document per row: the causal fast path
    device = torch.device(device)
    if device.type == "cuda" and dtype != torch.float32 and varlen_attn() is not None:
        flat = doc.reshape(-1)
        starts = torch.ones_like(flat, dtype=torch.bool)
        starts[1:] = flat[1:] != flat[:-1]
        starts[:: doc.shape[1]] = True  # every row starts a segment
        offsets = torch.nonzero(starts).flatten()
        cu = torch.cat([offsets, torch.tensor([flat.numel()])]).to(torch.int32)
        return Layout(cu_seqlens=cu.to(device), max_len=int((cu[1:] - cu[:-1]).max()))
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return Layout(mask=mask[:, None].to(device))


Head = Callable[["Transformer", torch.Tensor], torch.Tensor]
"""What a forward returns from the final hidden states (B, T, dim), given the model."""


class Attention(nn.Module):
    def __init__(self, cfg, ops):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = head_dim(cfg)
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.ops = ops
        # Context parallel (trainer/parallel/context.py): gathers every rank's keys and values.
        self.context: nn.Module | None = None

    def forward(self, x, cos, sin, layout: Layout):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim)
        q, k = self.ops.apply_rope(q, k, cos, sin)
        if self.context is not None:
            k, v = self.context(k), self.context(v)
        if layout.cu_seqlens is not None:
            out = _varlen(q, k, v, layout)
        else:
            mask = layout.mask
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=self.n_kv_heads != self.n_heads,
            ).transpose(1, 2)
        return self.wo(out.reshape(B, S, -1))


def _varlen(q, k, v, layout: Layout):
    B, S, H, D = q.shape
    params = inspect.signature(varlen_attn()).parameters
    causal: dict[str, tuple[int, int] | bool] = (
        {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    )
    if k.shape[2] != H and "enable_gqa" not in params:
        k, v = (t.repeat_interleave(H // t.shape[2], dim=2) for t in (k, v))
    elif k.shape[2] != H:
        causal["enable_gqa"] = True
    cu, n = layout.cu_seqlens, layout.max_len
    out = varlen_attn()(
        q.reshape(B * S, H, D),
        k.reshape(B * S, k.shape[2], D),
        v.reshape(B * S, v.shape[2], D),
        cu,
        cu,
        n,
        n,
        **causal,
    )
    return out.view(B, S, H, D)


class Block(nn.Module):
    def __init__(self, cfg, ops, recompute: str, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.attention = Attention(cfg, ops)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.feed_forward = moe.feed_forward(cfg, ops, layer)  # SwiGLU MLP, or experts
        self.recompute = recompute  # "NONE", "SELECTIVE" (attention) or "FULL" (the block)

    def _attend(self, x, cos, sin, layout):
        return self.attention(self.attention_norm(x), cos, sin, layout)

    def _forward(self, x, cos, sin, layout):
        if self.recompute == "SELECTIVE" and torch.is_grad_enabled():
            h = x + checkpoint(self._attend, x, cos, sin, layout, use_reentrant=False)
        else:
            h = x + self._attend(x, cos, sin, layout)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x, cos, sin, layout: Layout):
        if self.recompute == "FULL" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, layout, use_reentrant=False)
        return self._forward(x, cos, sin, layout)


class Transformer(nn.Module):
    """`cfg` is a resolved ModelConfig; `vocab_size` comes from the tokenizer."""

    def __init__(self, cfg, vocab_size: int, ops=reference, recompute: str = "NONE"):
        super().__init__()
        self.vocab_size, self.n_layers = vocab_size, cfg.n_layers
        self.tok_embeddings = nn.Embedding(vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, ops, recompute, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.output = nn.Linear(cfg.dim, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope = RotaryEmbedding(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta, ops)
        self.ops = ops
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2 style: N(0, 0.02), residual projections scaled down by depth, norms at 1."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                p.normal_(0.0, 0.02 / math.sqrt(2 * self.n_layers))
            else:
                p.normal_(0.0, 0.02)

    def hidden(self, input_ids, position_ids, layout: Layout | None = None):
        """The final normed hidden states, (B, T, dim)."""
        layout = layout or Layout()
        cos, sin = self.rope.cos_sin(position_ids)  # once per step, shared by every layer
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, layout)
        return self.norm(x)

    def forward(
        self, input_ids, position_ids, layout: Layout | None = None, head: "Head | None" = None
    ):
        """Logits (B, T, vocab) in fp32, or `head(self, hidden)` of the final hidden states:
        what a recipe computes from them (trainer/lm_loss.py's summed cross entropy, a scalar
        head's scores, ...). Through `forward`, so a DDP or FSDP wrapper sees the whole pass."""
        h = self.hidden(input_ids, position_ids, layout)
        if head is not None:
            return head(self, h)
        return F.linear(h, self.output.weight).float()

    def matmul_params(self) -> int:
        """Weights used in a matmul per token: the blocks and the output head (the input
        embedding is a table lookup), the N of 6·N in FLOPs per token, as torchtitan counts."""
        blocks = sum(p.numel() for p in self.layers.parameters())
        blocks -= moe.inactive_expert_params(self)  # a token uses k of E experts
        return blocks + self.output.weight.numel()
