"""DISTILL: knowledge distillation (Hinton et al. 2015). A student (trainer.model) learns, on
trainer.data's packed rows, a frozen teacher checkpoint's next-token distributions:

    loss per labelled token = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))
                              + (1 - alpha) * cross entropy of the data's next token

T = distill.temperature softens both distributions so the student also learns which wrong
tokens the teacher found likely; T^2 keeps the gradient's scale as T changes. The teacher
must read the data's tokens (the same tokenizer, trainer/interop/vocab.py's rule: a teacher
whose embedding is padded past that tokenizer, as published checkpoints are, is fine). Both
distributions are over the tokenizer's ids only: padded rows, of either model, are no token.
Everything else is the language-model recipe's: the data, the held-out eval (the student's
own loss on the data), checkpoints."""

from pathlib import Path
from typing import Self

import torch
import torch.nn.functional as F

from protos.config_yaml import ConfigError
from trainer import checkpoint, moe
from trainer.data.tokenizer import tokenizer_section
from trainer.interop import vocab
from trainer.model import attention_layout
from trainer.recipes.lm import LanguageModelRecipe


class DistillRecipe(LanguageModelRecipe):
    model_parallel = False  # the teacher is whole on every rank
    starting = "the student starts from"
    expert_parallel = False

    @classmethod
    def for_job(cls, ctx) -> Self:
        recipe = super().for_job(ctx)
        recipe.load_teacher()  # before the core seeds and builds the student
        return recipe

    def load_teacher(self) -> None:
        field, path = "trainer.distill.teacher_path", Path(self.cfg.distill.teacher_path)
        try:
            teacher, meta = checkpoint.load_model(path, self.device, self.cfg.model.use_kernels)
        except checkpoint.CheckpointError as e:
            raise ConfigError(field, str(e)) from e
        if problem := vocab.dataset_problem(path, meta, self.dataset):
            raise ConfigError(
                field,
                f"{path} cannot read the data's tokens: {problem}; precook the data with the "
                "teacher's tokenizer (tokenizer: BPE_FILE)",
            )
        self.ids = tokenizer_section(self.dataset).vocab_size
        self.teacher = teacher.requires_grad_(False).eval()
        params = sum(p.numel() for p in teacher.parameters())
        self.teacher_line = f"teacher {path} ({meta.kind} step {meta.step}, {params / 1e6:.2f} M)"

    def describe(self, model: torch.nn.Module) -> str:
        d = self.cfg.distill
        return (
            f"distilling from the {self.teacher_line}: temperature {d.temperature:g}, "
            f"alpha {d.alpha:g} on its distributions, {1 - d.alpha:g} on the data's tokens"
        )

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        layout = attention_layout(batch["document_ids"], self.device, self.dtype)
        b = {key: v.to(self.device, non_blocking=True) for key, v in batch.items()}
        labelled = b["labels"] != -100
        with torch.no_grad():
            teacher_logits = self.teacher(b["input_ids"], b["position_ids"], layout)[labelled]
            teacher_logits = teacher_logits[:, : self.ids]
        d = self.cfg.distill
        T, alpha = d.temperature, d.alpha

        def head(student, h: torch.Tensor) -> torch.Tensor:
            penalty = moe.collect(student)
            logits = F.linear(h[labelled], student.output.weight).float()
            lm = F.cross_entropy(logits, b["labels"][labelled], reduction="sum")
            teacher_logp = F.log_softmax(teacher_logits.float() / T, -1)
            student_logp = F.log_softmax(logits[:, : self.ids] / T, -1)
            kd = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="sum")
            return moe.with_penalty(alpha * T * T * kd + (1 - alpha) * lm, penalty)

        return model(b["input_ids"], b["position_ids"], layout, head=head)
