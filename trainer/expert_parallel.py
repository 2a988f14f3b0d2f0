"""Expert parallelism: each rank holds E/ep of every MoE layer's experts; tokens travel to them.

Ranks form world/ep expert groups of ep consecutive ranks; within a group every expert lives on
exactly one rank, and rank r of every group holds the same experts (its replicas). Every rank
still reads its own data (data parallel over all ranks), and everything but the experts is
replicated, as under DDP.

A MoE layer's forward (`ExpertGroup.__call__`): the rank's (token, slot) rows, already sorted by
expert, go to the ranks that hold those experts in one all_to_all (counts first, so each rank
knows what it receives); the receiver regroups them by local expert, runs one grouped GEMM per
weight, and a second all_to_all returns each row to where it came from. Both all_to_alls are
differentiable (the backward is the reverse all_to_all), so gradients reach the experts and
flow back to the tokens.

Gradients (`ExpertParallel`): the loop scales each rank's loss by world/tokens, as for DDP; at
the end of a step's last backward, replicated gradients are summed over all ranks and expert
gradients over their replicas, both divided by the world size: exactly the gradient one process
would compute on the global batch. The norm for clipping spans every rank's experts.

Checkpoints hold the full model, as one process would write it: expert weights and their
AdamW moments are gathered over the expert group on save and sliced again on load, so a run
resumes with another layout (or evaluates on one process).
"""

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer import moe
from trainer.distributed import DistEnv

EXPERT_PARAMS = ("experts.w13", "experts.w2")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


class ExpertGroup:
    """One MoE layer's dispatch and combine over the ranks of an expert group."""

    def __init__(self, group, size: int, n_experts: int):
        self.group, self.size, self.local = group, size, n_experts // size

    def __call__(self, experts: moe.Experts, rows: torch.Tensor, counts: torch.Tensor):
        """`rows` sorted by (global) expert, `counts[e]` of them for expert e: each row's output
        of its expert, in the same order."""
        ep, local = self.size, self.local
        send = counts.to(torch.int64).reshape(ep, local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[r, j]: rank r -> my expert j
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = _AllToAll.apply(rows, out_splits, in_splits, self.group)
        # Received rows come by source rank, then expert; the experts want them by expert.
        sizes = recv.tolist()
        starts: list[list[int]] = []
        offset = 0
        for r in range(ep):
            starts.append([])
            for j in range(local):
                starts[r].append(offset)
                offset += sizes[r][j]
        by_expert = [
            torch.arange(starts[r][j], starts[r][j] + sizes[r][j])
            for j in range(local)
            for r in range(ep)
        ]
        perm = torch.cat(by_expert).to(rows.device)
        group_sizes = [sum(sizes[r][j] for r in range(ep)) for j in range(local)]
        out = experts(received[perm], group_sizes)
        back = torch.empty_like(perm).index_copy_(0, perm, torch.arange(len(perm)).to(perm))
        return _AllToAll.apply(out[back], in_splits, out_splits, self.group)


def _is_expert(name: str) -> bool:
    return name.endswith(EXPERT_PARAMS)


class ExpertParallel(nn.Module):
    """`module` with its experts sharded over expert groups of `ep` ranks (see module doc).
    Quacks like DDP where the loop asks: `module`, `no_sync`; and offers what DDP needs not:
    `clip_grad_norm_` and full-state checkpoint methods."""

    def __init__(self, module: nn.Module, env: DistEnv, ep: int):
        super().__init__()
        self.module, self.world, self.ep = module, env.world_size, ep
        self.ep_rank = env.rank % ep
        # Every rank creates every group, in the same order (new_group is collective).
        expert_groups = [dist.new_group(list(range(g, g + ep))) for g in range(0, self.world, ep)]
        replica_groups = [dist.new_group(list(range(j, self.world, ep))) for j in range(ep)]
        self.expert_group = expert_groups[env.rank // ep]
        self.replica_group = replica_groups[self.ep_rank]
        for layer in moe.moe_layers(module):
            local = layer.n_experts // ep
            first = self.ep_rank * local
            e = layer.experts
            e.w13 = nn.Parameter(e.w13.detach()[first : first + local].clone())
            e.w2 = nn.Parameter(e.w2.detach()[first : first + local].clone())
            e.first = first
            layer.dispatch = ExpertGroup(self.expert_group, ep, layer.n_experts)
        self.require_sync, self._pending = True, False
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._on_grad)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._pending = self.require_sync  # decided at forward time, as DDP does
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def _on_grad(self, _param) -> None:
        if self._pending:
            self._pending = False
            torch.autograd.Variable._execution_engine.queue_callback(self._sync_gradients)

    def _split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dense: list[nn.Parameter] = []
        experts: list[nn.Parameter] = []
        for name, p in self.module.named_parameters():
            (experts if _is_expert(name) else dense).append(p)
        return dense, experts

    def _sync_gradients(self) -> None:
        dense, experts = self._split()
        for params, group in ((dense, None), (experts, self.replica_group)):
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            flat = torch._utils._flatten_dense_tensors(grads)
            if group is None or self.world > self.ep:
                dist.all_reduce(flat, group=group)
            flat /= self.world
            for g, synced in zip(
                grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
            ):
                g.copy_(synced)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model, experts of every rank included."""
        dense, experts = self._split()

        def sq(params):
            grads = [p.grad for p in params if p.grad is not None]
            norms = torch._foreach_norm(grads) if grads else []
            return sum((n.double() ** 2 for n in norms), torch.zeros((), dtype=torch.float64))

        expert_sq = sq(experts)
        dist.all_reduce(expert_sq, group=self.expert_group)
        total = torch.sqrt(sq(dense) + expert_sq).float()
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for p in dense + experts:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad))
        return total

    # ------------------------------------------------------------------ checkpoints

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.ep)]
        dist.all_gather(parts, t.contiguous(), group=self.expert_group)
        return torch.cat(parts)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        local = t.shape[0] // self.ep
        return t[self.ep_rank * local : (self.ep_rank + 1) * local]

    def full_state_dict(self) -> dict:
        """The model state as one process holds it (collective)."""
        state = self.module.state_dict()
        return {
            k: (self._gather(v) if _is_expert(k) else v).detach().cpu() for k, v in state.items()
        }

    def load_full_state_dict(self, state: dict) -> None:
        mine = {k: self._slice(v) if _is_expert(k) else v for k, v in state.items()}
        self.module.load_state_dict(mine)

    def _expert_indices(self, optimizer) -> set[int]:
        ids = {id(p) for n, p in self.module.named_parameters() if _is_expert(n)}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {i for i, p in enumerate(params) if id(p) in ids}

    def full_optimizer_state_dict(self, optimizer) -> dict:
        """AdamW's state as one process holds it: expert moments gathered (collective)."""
        sd = optimizer.state_dict()
        experts = self._expert_indices(optimizer)
        state = {}
        for i, s in sd["state"].items():
            state[i] = {
                k: self._gather(v) if i in experts and v.dim() > 0 else v for k, v in s.items()
            }
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_full_optimizer_state_dict(self, optimizer, sd: dict) -> None:
        experts = self._expert_indices(optimizer)
        state = {
            i: {k: self._slice(v) if i in experts and v.dim() > 0 else v for k, v in s.items()}
            for i, s in sd["state"].items()
        }
        optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def wrap(model: nn.Module, env: DistEnv, ep: int) -> nn.Module:
    """`model` with experts sharded over `ep` ranks (protos/validation_layout.py checked that ep
    divides the processes and the experts); the model itself on one process."""
    if env.world_size == 1:
        return model
    return ExpertParallel(model, env, ep)
