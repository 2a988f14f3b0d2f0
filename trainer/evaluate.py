"""Held-out loss and perplexity, and a multiple-choice accuracy built offline from held-out text.

The multiple-choice task needs no download: from documents of the eval split (or chunks of
the long ones, as precook packed them), each question is the first CONTEXT tokens of one and
CHOICES candidate continuations of CONTEXT tokens: its own, and the same span of others. The
model picks the candidate whose likelihood the context raises most. Chance is 1/CHOICES; a
model that learned something about the text does better.
"""

import math
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from protos.trainer_config_pb2 import TrainerConfig
from trainer import distributed
from trainer.distributed import DistEnv
from trainer.lm_loss import summed_loss
from trainer.model import attention_layout

if TYPE_CHECKING:
    from trainer.parallel.engine import Engine

CONTEXT = 32
CHOICES = 4


class HeldoutLoss(NamedTuple):
    loss: float  # mean cross entropy per labelled token, nats
    perplexity: float
    tokens: int  # labelled tokens it was measured on


def _eval_loader(dataset_path: str | Path, cfg: TrainerConfig, rank: int, ranks: int):
    """The eval split's loader for data-parallel rank `rank` of `ranks`, or None when the
    split has no rows."""
    from trainer.data.loader import PackedRowLoader

    try:
        return PackedRowLoader(
            str(dataset_path),
            split="eval",
            batch_size=cfg.train.micro_batch,
            seed=cfg.train.seed,
            rank=rank,
            world_size=ranks,
        )
    except ValueError:  # no rows: eval_fraction 0, or too few documents
        return None


def _autocast(device, dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    dataset_path: str | Path,
    cfg: TrainerConfig,
    env: DistEnv,
    dtype: torch.dtype,
    engine: "Engine | None" = None,
) -> HeldoutLoss | None:
    """Mean loss over the first `train.eval_batches` batches of the eval split; None when the
    split is empty. Each data-parallel rank takes its own share of the rows, and the sums add
    over data parallel only. Under a model-parallel layout pass the trainer's `engine`: the
    ranks of one model replica (tensor, context, pipeline) read the same rows and run one
    sharded forward; without it every rank is a data-parallel rank (one process, DDP, FSDP,
    expert parallel)."""
    rank, ranks = engine.data_rank if engine else (env.rank, env.world_size)
    loader = _eval_loader(dataset_path, cfg, rank, ranks)
    if loader is None:
        return None
    # Every rank must run the same number of forwards (FSDP gathers weights collectively).
    n = min(distributed.gather_objects(min(len(loader), cfg.train.eval_batches)))
    if n == 0:
        return None
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    batches = iter(loader)
    for _ in range(n):
        b = next(batches)
        if engine is not None:
            totals += engine.heldout_sums(b)
            continue
        layout = attention_layout(b["document_ids"], env.device, dtype)
        b = {k: v.to(env.device) for k, v in b.items()}
        with _autocast(env.device, dtype):
            totals[0] += summed_loss(
                model, b["input_ids"], b["position_ids"], layout, b["labels"]
            ).double()
        totals[1] += (b["labels"] != -100).sum()
    model.train(was_training)
    if engine is not None:
        engine.replica_sum(totals)
        if engine.layout.dp > 1:
            dist.all_reduce(totals, group=engine.mesh.group("dp"))
    else:
        distributed.all_reduce_sum(totals)
    loss_sum, tokens = totals.tolist()
    if tokens == 0:
        return None
    loss = loss_sum / tokens
    return HeldoutLoss(loss, math.exp(min(loss, 700.0)), int(tokens))


def _documents(loader, batches: int, min_len: int) -> list[torch.Tensor]:
    """Token runs of the segments (documents, or chunks of long ones) at least `min_len` long
    in the first batches."""
    docs = []
    for _ in range(batches):
        b = next(loader)
        for ids, doc in zip(b["input_ids"], b["document_ids"], strict=True):
            for d in doc.unique().tolist():
                where = (doc == d).nonzero().flatten()
                if d >= 0 and len(where) >= min_len:
                    docs.append(ids[where])
    return docs


def _log_likelihood(model, prefix: torch.Tensor, candidates: torch.Tensor, device, dtype):
    """log p(candidate | prefix) for each row of `candidates` (n, L) after `prefix` (P,)."""
    ids = torch.cat([prefix.expand(len(candidates), -1), candidates], dim=1).to(device)
    positions = torch.arange(ids.shape[1], device=device).expand(len(ids), -1)
    with _autocast(device, dtype):
        logits = model(ids, positions)
    logp = F.log_softmax(logits[:, len(prefix) - 1 : -1].float(), dim=-1)
    return logp.gather(-1, ids[:, len(prefix) :, None]).sum(dim=(1, 2))


@torch.no_grad()
def choice_accuracy(
    model: torch.nn.Module,
    dataset_path: str | Path,
    cfg: TrainerConfig,
    env: DistEnv,
    dtype: torch.dtype,
    questions: int = 128,
) -> tuple[float, int]:
    """(accuracy, questions asked) of the continuation-choice task; (nan, 0) if the eval
    split has too few long documents.

    A candidate's score is how much the context raises its likelihood: log p(c | context) -
    log p(c | <bos>). Raw log p(c | context) mostly measures how ordinary a candidate is (a
    run of blank lines beats any real code), which hides what the context taught the model.
    """
    from trainer.data.tokenizer import load_tokenizer

    loader = _eval_loader(dataset_path, cfg, env.rank, env.world_size)
    if loader is None:
        return math.nan, 0
    docs = _documents(loader, min(len(loader), 4 * cfg.train.eval_batches), 2 * CONTEXT)
    if len(docs) < CHOICES:
        return math.nan, 0
    bos = torch.tensor([load_tokenizer(str(dataset_path)).bos_id])
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(cfg.train.seed)
    correct = asked = 0
    for i in range(min(questions, len(docs))):
        others = [j for j in torch.randperm(len(docs), generator=g).tolist() if j != i]
        candidates = [docs[i][CONTEXT : 2 * CONTEXT]]
        candidates += [docs[j][CONTEXT : 2 * CONTEXT] for j in others[: CHOICES - 1]]
        candidates = torch.stack(candidates)
        score = _log_likelihood(model, docs[i][:CONTEXT], candidates, env.device, dtype)
        score -= _log_likelihood(model, bos, candidates, env.device, dtype)
        correct += int(score.argmax()) == 0
        asked += 1
    model.train(was_training)
    return correct / asked, asked
