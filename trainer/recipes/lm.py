"""PRETRAIN and SFT: next-token prediction on precooked packed rows (trainer/data/loader.py).

SFT rows carry labels only on response tokens (precook masks the prompt), and the run starts
from `checkpoint.path`; otherwise the two are the same recipe. It is the one that allows every
parallel layout: tensor, sequence, pipeline, context and expert parallel."""

import math
from pathlib import Path

import torch

from protos import job_pb2
from protos.defaults import head_dim
from protos.enums import enum_name
from trainer import checkpoint, evaluate, model_setup
from trainer.data.loader import PackedRowLoader
from trainer.lm_loss import packed_rows_loss
from trainer.loop import Trainer
from trainer.recipe import BatchCounts, Evaluation, Recipe
from trainer.sizing import flops


class LanguageModelRecipe(Recipe):
    model_parallel = True
    expert_parallel = True
    starting = "fine-tuning from"  # the log line of a start from checkpoint.path

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A start from a checkpoint whose embedding is padded past its own tokenizer, the
        # data's (a published model imported: 777 ids, 832 rows), keeps the checkpoint's rows;
        # any other difference is refused by checkpoint.pretrained in start().
        if self.kind != job_pb2.PRETRAIN and self.cfg.checkpoint.path:
            from trainer.interop import vocab

            path = Path(self.cfg.checkpoint.path)
            try:
                meta = checkpoint.verify(path, files=())
            except checkpoint.CheckpointError:
                return  # start() names what is wrong
            if vocab.dataset_problem(path, meta, self.dataset) is None:
                self.vocab_size = max(self.vocab_size, meta.vocab_size)

    def build(self) -> torch.nn.Module:
        # model_setup's one recipe for the Transformer of a config (it seeds from train.seed
        # again, as set_up just did: the same weights)
        recompute = enum_name(self.cfg.train, "recompute")
        return model_setup.build_model(self.cfg, self.vocab_size, self.device, recompute)

    def start(self, model: torch.nn.Module) -> str:
        """SFT starts from checkpoint.path; a DISTILL student may (PRETRAIN ignores it)."""
        if self.kind == job_pb2.PRETRAIN or not self.cfg.checkpoint.path:
            return ""
        path = Path(self.cfg.checkpoint.path)
        meta = checkpoint.pretrained(path, self.cfg.model, self.vocab_size)
        checkpoint.load_model_state(model, checkpoint.language_model_state(path))
        return f"{self.starting} {path} (step {meta.step})"

    def flops_per_token(self, model: torch.nn.Module) -> float:
        m = self.cfg.model
        return flops.flops_per_token(
            model.matmul_params(), m.n_layers, m.n_heads, head_dim(m), self.cfg.data.seq_len
        )

    def batches(self, rank: int, ranks: int, model: torch.nn.Module) -> PackedRowLoader:
        t = self.cfg.train
        return PackedRowLoader(
            self.dataset,
            split="train",
            batch_size=t.micro_batch,
            seed=t.seed,
            rank=rank,
            world_size=ranks,
        )

    def counts(self, batch: dict) -> BatchCounts:
        positions = batch["document_ids"].numel()
        padding = int((batch["document_ids"] < 0).sum())
        return BatchCounts(float((batch["labels"] != -100).sum()), positions - padding, positions)

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return packed_rows_loss(model, batch, self.device, self.dtype)

    def evaluate(self, model: torch.nn.Module, step: int) -> Evaluation | None:
        result = evaluate.heldout_loss(
            model, self.dataset, self.cfg, self.env, self.dtype, self.engine
        )
        if result is None:
            return Evaluation(math.nan, "eval: the held-out split is empty; no eval loss")
        message = (
            f"eval at step {step}: loss {result.loss:.4f}, perplexity "
            f"{result.perplexity:,.2f} over {result.tokens:,} held-out tokens"
        )
        score = {"task": "heldout", "metric": "loss", "value": result.loss}
        return Evaluation(result.loss, message, {"eval_loss": result.loss}, [score])


def lm_trainer(
    cfg, run_dir, env, dataset: str, vocab_size: int, *, log, kind=job_pb2.PRETRAIN
) -> "Trainer":
    """A Trainer of this recipe outside a job (tests, benchmarks)."""
    from trainer.config import train_dtype

    dtype = train_dtype(cfg, env.device)
    recipe = LanguageModelRecipe(cfg, kind, env, str(dataset), vocab_size, dtype, log)
    return Trainer(recipe, run_dir, log=log)
