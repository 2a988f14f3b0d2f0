"""VLM: a vision-language model trained in a stage (ALIGN: the projector, and the encoder with
vision.train_encoder; FINETUNE: everything) on precooked image+text rows, then evaluated on the
held-out images (trainer/vlm/evaluate.py). A stage starts from `checkpoint.path` when given: a
text checkpoint (its language model) or a VLM checkpoint of an earlier stage (the whole model).
"""

from collections import deque
from pathlib import Path

import torch

from protos.config_yaml import ConfigError
from protos.enums import enum_name
from protos.files import write_json_atomic
from protos.trainer_config_pb2 import TrainerConfig
from trainer import checkpoint, distributed
from trainer.data.image_loader import ImageRowLoader
from trainer.data.loader import IGNORE
from trainer.lm_loss import next_token_loss
from trainer.recipe import BatchCounts, Recipe
from trainer.vlm.model import VisionLanguageModel


def build_vlm(cfg: TrainerConfig, vocab_size: int, device) -> VisionLanguageModel:
    recompute = enum_name(cfg.train, "recompute")
    return VisionLanguageModel(cfg, vocab_size, device, recompute).to(device)


class VlmRecipe(Recipe):
    def build(self) -> torch.nn.Module:
        self.stage = enum_name(self.cfg.vision, "stage")
        return build_vlm(self.cfg, self.vocab_size, self.device)

    def start(self, model: VisionLanguageModel) -> str:
        started = ""
        if self.cfg.checkpoint.path:
            started = f"{self.stage} starts from " + self._load_start(model)
        self.trained = model.set_stage(self.stage, self.cfg.vision.train_encoder)
        self.image_tokens = model.image_tokens
        return started

    def _load_start(self, model: VisionLanguageModel) -> str:
        """`checkpoint.path` into `model`: a VLM checkpoint whole, a text one into the LM."""
        path = Path(self.cfg.checkpoint.path)
        meta = checkpoint.pretrained(path, self.cfg.model, self.vocab_size)
        if meta.kind == "VLM":
            state = torch.load(path / "model.pt", map_location="cpu", mmap=True, weights_only=True)
            try:
                checkpoint.load_model_state(model, state)
            except RuntimeError as e:  # another encoder or projector shape
                raise ConfigError("trainer.vision", f"does not match the VLM of {path}: {e}") from e
            return f"the VLM of {path} (step {meta.step})"
        checkpoint.load_model_state(model.lm, checkpoint.language_model_state(path))
        return f"the language model of {path} ({meta.kind}, step {meta.step})"

    def shard_units(self, model: VisionLanguageModel) -> list[torch.nn.Module]:
        return [*model.encoder.layers, *model.lm.layers]

    def language_model(self, model: VisionLanguageModel) -> torch.nn.Module:
        return model.lm

    def flops_per_token(self, model: VisionLanguageModel) -> float:
        stats = ImageRowLoader(self.dataset, "train").data.manifest.splits["train"]
        text_per_row = (stats.text_tokens - stats.truncated_tokens) / max(stats.records, 1)
        return model.flops_per_example(text_per_row) / (model.image_tokens + text_per_row)

    def describe(self, model: VisionLanguageModel) -> str:
        v = self.cfg.vision
        params = lambda part: sum(p.numel() for p in getattr(model, part).parameters()) / 1e6
        return (
            f"VLM {self.stage}: encoder {params('encoder'):.2f} M, projector "
            f"{params('projector'):.2f} M, LM {params('lm'):.2f} M parameters; training "
            f"{', '.join(self.trained)}; {model.image_tokens} image tokens per image "
            f"({model.encoder.grid**2} patches / pixel_shuffle {v.pixel_shuffle}^2)"
        )

    def batches(self, rank: int, ranks: int, model) -> ImageRowLoader:
        t = self.cfg.train
        loader = ImageRowLoader(self.dataset, "train", t.micro_batch, t.seed, rank, ranks)
        self.pad_id = loader.pad_id
        # (image tokens, tokens) of the last step's micro-batches on this rank
        self.step_tokens: deque[tuple[int, int]] = deque(maxlen=t.grad_accum)
        return loader

    def counts(self, batch: dict) -> BatchCounts:
        rows = len(batch["input_ids"])
        text = int((batch["input_ids"] != self.pad_id).sum())
        tokens = rows * self.image_tokens + text
        self.step_tokens.append((rows * self.image_tokens, tokens))
        positions = rows * (self.image_tokens + self.cfg.data.seq_len)
        return BatchCounts(float((batch["labels"] != IGNORE).sum()), tokens, positions)

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        b = {key: t.to(self.device) for key, t in batch.items()}
        labels = b["labels"]
        pad = labels.new_full((labels.shape[0], self.image_tokens), IGNORE)
        return model(b["images"], b["input_ids"], head=next_token_loss(torch.cat([pad, labels], 1)))

    def step_fields(self) -> dict:
        """The last step's share of image tokens in its global batch (a collective)."""
        image = sum(i for i, _ in self.step_tokens)
        local = torch.tensor([image, sum(t for _, t in self.step_tokens)], dtype=torch.float64)
        image, tokens = distributed.all_reduce_sum(local.to(self.device)).tolist()
        return {"image_token_share": image / max(tokens, 1.0)}

    def finish(self, model: torch.nn.Module, run_dir, step: int) -> None:
        """The held-out images' answers, decoded on the inference engine (every rank runs it,
        with the weights gathered whole under FSDP); rank 0 writes the report."""
        from trainer.vlm import evaluate

        with distributed.whole(model) as whole:  # the engine reads weights outside forward
            report = evaluate.evaluate(whole, self.dataset, self.device)
        self.log(evaluate.describe(report))
        if self.env.is_main:
            write_json_atomic(str(Path(run_dir) / evaluate.REPORT), report)
