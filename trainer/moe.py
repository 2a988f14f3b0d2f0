"""Mixture-of-experts feed-forward layers: top-k routing, load balancing, grouped expert compute.

A MoE layer replaces a block's SwiGLU MLP with `moe_experts` SwiGLU experts and a router. Each
token goes to its `moe_top_k` best experts; their outputs are summed with the gate weights;
`moe_shared_experts` always-on experts (DeepSeek) are added to every token.

Routing (`Router`): SOFTMAX gates are softmax probabilities, top-k renormalized when k > 1
(Mixtral; k = 1 keeps the raw probability, Switch). SIGMOID gates are independent sigmoid
scores normalized over the chosen k (DeepSeek-V3).

Balancing, because a router left alone collapses: the experts it favours early get more
gradient, improve, and are favoured more (docs/moe.md shows it happen).
- AUX_LOSS: Switch/GShard's E·sum_i f_i·P_i (f_i: share of assignments to expert i, P_i: mean
  router probability of i), 1 when even, E when collapsed; its gradient flows through P.
- AUX_FREE_BIAS: DeepSeek-V3's per-expert bias, added to the scores for choosing experts only
  (never to the gate weights); after each optimizer step it moves by `moe_bias_update_rate`
  towards the experts that got fewer tokens than the mean.
- The router z-loss (ST-MoE) mean(logsumexp(logits)²) keeps router logits small.
The auxiliary terms are computed per micro-batch on the tokens this rank sees (as Megatron
does by default), in the loss's summed form (times the micro-batch's tokens), and added to the
loss's gradient but not its value (`with_penalty`): the reported loss stays cross entropy, so
dense and MoE runs compare.

Capacity: with `moe_capacity_factor` c > 0 an expert takes at most ceil(c·tokens·k/E) of this
rank's assignments per micro-batch, first come first served; the rest are dropped (the token
keeps its residual and its other experts) and counted. 0 is dropless (MegaBlocks).

Compute is grouped by expert: the (token, slot) assignments are sorted by expert so each
expert's rows are one slice, then one `grouped_gemm` per weight (kernels: Triton on a GPU or
in the interpreter, else the PyTorch reference). Under expert parallelism the sorted rows
travel to the experts' ranks and back (trainer/expert_parallel.py).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.modules import SwiGLUMLP
from protos import trainer_config_pb2
from protos.enums import enum_name

STATS = ("assignments", "dropped", "aux", "z", "entropy", "tokens", "skew", "micro_batches")


def is_moe_layer(cfg: trainer_config_pb2.ModelConfig, layer: int) -> bool:
    """Whether block `layer` has experts: every `moe_every`-th block, counting from 1, after
    the first `moe_first_dense` (trainer/sizing/moe.py's MoESpec.moe_layers counts the same)."""
    return cfg.moe_experts > 0 and layer >= cfg.moe_first_dense and (layer + 1) % cfg.moe_every == 0


def feed_forward(cfg: trainer_config_pb2.ModelConfig, ops, layer: int) -> nn.Module:
    """Block `layer`'s feed-forward: a MoE layer or the dense SwiGLU MLP."""
    if is_moe_layer(cfg, layer):
        return MoEFeedForward(cfg, ops, layer)
    return SwiGLUMLP(cfg.dim, cfg.ffn_dim, ops)


@dataclass
class Routing:
    experts: torch.Tensor  # (N, k) chosen expert per token and slot
    weights: torch.Tensor  # (N, k) gate weights, fp32
    probs: torch.Tensor  # (N, E) router distribution (normalized scores for SIGMOID), fp32
    logits: torch.Tensor  # (N, E) fp32


class Router(nn.Module):
    def __init__(self, cfg: trainer_config_pb2.ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.gate = enum_name(cfg, "moe_gate")
        self.weight = nn.Parameter(torch.empty(cfg.moe_experts, cfg.dim))
        # AUX_FREE_BIAS's selection bias: state (checkpointed), not a parameter (no gradient).
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())  # routing in fp32, as everywhere
        if self.gate == "SIGMOID":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = torch.softmax(logits, dim=-1)
        experts = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(experts, weights, probs, logits)


class Experts(nn.Module):
    """`n` SwiGLU experts as stacked weights: w13 (n, dim, 2·ffn) for gate and up, w2 (n, ffn,
    dim). Under expert parallelism a rank holds a slice of them (`first` is its first)."""

    def __init__(self, n: int, dim: int, ffn_dim: int, ops):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n, dim, 2 * ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n, ffn_dim, dim))
        self.ops, self.first = ops, 0

    def forward(self, x: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        """Rows of `x` sorted by expert, `group_sizes[i]` of them for this module's expert i."""
        w13, w2 = self.w13, self.w2
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        gate, up = self.ops.grouped_gemm(x, w13, group_sizes).chunk(2, dim=-1)
        return self.ops.grouped_gemm(self.ops.swiglu(gate, up), w2, group_sizes)


@dataclass
class LayerStats:
    """What one MoE layer saw since the last report (all ranks' once reduced)."""

    tokens_per_expert: torch.Tensor  # float64 (E,)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATS, 0.0))


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: trainer_config_pb2.ModelConfig, ops, layer: int):
        super().__init__()
        self.layer, self.n_experts, self.top_k = layer, cfg.moe_experts, cfg.moe_top_k
        self.router = Router(cfg)
        self.experts = Experts(cfg.moe_experts, cfg.dim, cfg.moe_ffn_dim, ops)
        shared = cfg.moe_shared_experts
        self.shared = SwiGLUMLP(cfg.dim, shared * cfg.moe_ffn_dim, ops) if shared else None
        self.balance = enum_name(cfg, "moe_balance")
        self.aux_coef = cfg.moe_aux_loss_coef if self.balance == "AUX_LOSS" else 0.0
        self.z_coef, self.capacity_factor = cfg.moe_z_loss_coef, cfg.moe_capacity_factor
        self.bias_rate = cfg.moe_bias_update_rate
        # expert_parallel.ExpertGroup when experts are sharded: (experts, rows, counts) -> rows
        self.dispatch: Callable[[Experts, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Set by each training forward, read by the Transformer right after (`collect`): a
        # recomputation in backward (activation checkpointing) overwrites it harmlessly.
        self.penalty: torch.Tensor | None = None
        self.record: dict[str, torch.Tensor] = {}
        self.stats = LayerStats(torch.zeros(cfg.moe_experts, dtype=torch.float64))
        self.step_load = torch.zeros(cfg.moe_experts, dtype=torch.float64)

    def capacity(self, n_tokens: int) -> int:
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dim = x.shape, x.shape[-1]
        x = x.reshape(-1, dim)
        n, k, E = x.shape[0], self.top_k, self.n_experts
        r = self.router(x)
        flat = r.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order
        counts = torch.bincount(flat, minlength=E)
        routed = counts
        if self.capacity_factor > 0:
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(n * k, device=x.device) - starts[flat[order]]
            order = order[rank_in_expert < self.capacity(n)]
            routed = counts.clamp(max=self.capacity(n))
        tokens = order // k
        rows = x[tokens]
        sizes = routed.tolist()
        if self.dispatch is None:
            y = self.experts(rows, sizes)
        else:
            y = self.dispatch(self.experts, rows, routed)
        gates = r.weights.reshape(-1)[order].to(y.dtype)
        out = torch.zeros(n, dim, device=x.device, dtype=y.dtype)
        out = out.index_add_(0, tokens, y * gates[:, None])
        if self.shared is not None:
            out = out + self.shared(x)
        if torch.is_grad_enabled():
            self._account(r, counts, n, n * k - int(order.numel()))
        return out.reshape(shape)

    def _account(self, r: Routing, counts: torch.Tensor, n: int, dropped: int) -> None:
        """The penalty (summed form) and the statistics of this micro-batch's routing."""
        E = self.n_experts
        f = counts.float() / (n * self.top_k)
        aux = E * (f * r.probs.mean(0)).sum()
        z = torch.logsumexp(r.logits, dim=-1).square().sum()
        self.penalty = self.aux_coef * aux * n + self.z_coef * z
        p = r.probs.detach()
        entropy = -(p * torch.log(p.clamp_min(1e-20))).sum(-1).sum() / math.log(max(E, 2))
        self.record = {
            "counts": counts.detach(),
            "assignments": torch.tensor(float(n * self.top_k)),
            "dropped": torch.tensor(float(dropped)),
            "aux": aux.detach(),
            "z": z.detach(),
            "entropy": entropy,
            "tokens": torch.tensor(float(n)),
            "skew": counts.max().float() / counts.float().mean(),
        }


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def collect(model: nn.Module) -> torch.Tensor | None:
    """After a training forward: fold each MoE layer's record into its statistics and return
    the summed auxiliary penalty (None for a dense model or without gradients)."""
    penalty = None
    for layer in moe_layers(model):
        if layer.record:
            rec, s = layer.record, layer.stats
            counts = rec["counts"].double().cpu()
            s.tokens_per_expert += counts
            layer.step_load += counts
            for name in ("assignments", "dropped", "aux", "z", "entropy", "tokens", "skew"):
                s.totals[name] += float(rec[name])
            s.totals["micro_batches"] += 1
            layer.record = {}
        if layer.penalty is not None:
            penalty = layer.penalty if penalty is None else penalty + layer.penalty
            layer.penalty = None
    return penalty


def with_penalty(loss: torch.Tensor, penalty: torch.Tensor | None) -> torch.Tensor:
    """`loss`'s value with `loss + penalty`'s gradient: the balancing terms train the router
    while the loss reported stays the language-model loss."""
    if penalty is None:
        return loss
    return loss + (penalty - penalty.detach()).to(loss.dtype)


def inactive_expert_params(model: nn.Module) -> int:
    """Expert weights a token does not use: (E − k) experts in each MoE layer. Subtracted from
    the matmul parameters, so FLOPs per token and MFU count active parameters only."""
    total = 0
    for layer in moe_layers(model):
        per_expert = layer.experts.w13[0].numel() + layer.experts.w2[0].numel()
        total += (layer.n_experts - layer.top_k) * per_expert
    return total


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


@torch.no_grad()
def end_step(model: nn.Module, updated: bool) -> None:
    """After an optimizer step (collective): AUX_FREE_BIAS moves each expert's bias towards
    the mean load of the step over all ranks; every layer's step load is cleared."""
    for layer in moe_layers(model):
        load = layer.step_load
        layer.step_load = torch.zeros_like(load)
        if layer.balance != "AUX_FREE_BIAS" or not updated:
            continue
        load = _all_reduce(load.clone())
        bias = layer.router.expert_bias
        bias += (layer.bias_rate * torch.sign(load.mean() - load)).to(bias)


def progress_fields(model: nn.Module) -> dict:
    """Progress's MoE fields for the steps since the last call (collective: sums every rank's
    statistics), or {} for a dense model. Resets the statistics."""
    from protos import progress_pb2

    layers = moe_layers(model)
    if not layers:
        return {}
    packed = torch.cat(
        [torch.cat([m.stats.tokens_per_expert, torch.tensor([m.stats.totals[s] for s in STATS],
                                                          dtype=torch.float64)]) for m in layers]
    )  # fmt: skip
    packed = _all_reduce(packed)
    out, offset, dropped, assignments = [], 0, 0.0, 0.0
    for m in layers:
        E = m.n_experts
        counts, totals = packed[offset : offset + E], packed[offset + E : offset + E + len(STATS)]
        offset += E + len(STATS)
        t = dict(zip(STATS, totals.tolist(), strict=True))
        m.stats = LayerStats(torch.zeros(E, dtype=torch.float64))
        mean = float(counts.mean())
        dropped, assignments = dropped + t["dropped"], assignments + t["assignments"]
        out.append(
            progress_pb2.MoeLayerStats(
                layer=m.layer,
                tokens_per_expert=[int(c) for c in counts.tolist()],
                imbalance=float(counts.max()) / mean if mean else 0.0,
                dropped_fraction=t["dropped"] / max(t["assignments"], 1.0),
                aux_loss=t["aux"] / max(t["micro_batches"], 1.0),
                z_loss=t["z"] / max(t["tokens"], 1.0),
                router_entropy=t["entropy"] / max(t["tokens"], 1.0),
                micro_batch_imbalance=t["skew"] / max(t["micro_batches"], 1.0),
            )
        )
    return {
        "moe_layers": out,
        "moe_max_imbalance": max(s.imbalance for s in out),
        "moe_dropped_fraction": dropped / max(assignments, 1.0),
        "moe_min_router_entropy": min(s.router_entropy for s in out),
    }
