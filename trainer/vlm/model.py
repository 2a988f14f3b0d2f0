"""The vision-language model: ViT encoder -> pixel-shuffle projector -> Kitchen's Transformer.

A row is [image tokens] <bos> text <eos> [padding]: the projected image takes the first
`image_tokens` positions of the language model's input, in place of token embeddings, and the
text follows with positions continuing after them. Attention is causal over the row (one record
per row, so it never crosses records; padding comes last and is never attended to by a token
that carries a loss). The loss is on text targets only.
"""

import torch
import torch.nn as nn

from protos.defaults import head_dim
from protos.trainer_config_pb2 import ModelConfig, TrainerConfig
from trainer.model import Head, Layout, Transformer, select_ops
from trainer.sizing import flops
from trainer.vlm.encoder import VisionEncoder
from trainer.vlm.projector import Projector


def image_tokens(cfg: TrainerConfig) -> int:
    """Language-model positions one image takes: (patch grid / pixel_shuffle)^2."""
    v = cfg.vision
    return (v.image_size // v.patch_size // v.pixel_shuffle) ** 2


def lm_config(cfg: TrainerConfig) -> ModelConfig:
    """cfg.model with room for the image tokens in front of data.seq_len text tokens."""
    out = ModelConfig()
    out.CopyFrom(cfg.model)
    out.max_seq_len = max(out.max_seq_len, cfg.data.seq_len + image_tokens(cfg))
    return out


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg: TrainerConfig, vocab_size: int, device, recompute: str = "NONE"):
        super().__init__()
        ops = select_ops(cfg.model.use_kernels, device)
        v = cfg.vision
        self.encoder = VisionEncoder(v, ops)
        self.projector = Projector(v.dim, self.encoder.grid, v.pixel_shuffle, cfg.model.dim)
        self.lm = Transformer(lm_config(cfg), vocab_size, ops=ops, recompute=recompute)
        self.image_tokens = self.projector.image_tokens
        self.cfg = cfg

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, S, S, 3) uint8 -> (B, image_tokens, lm dim)."""
        return self.projector(self.encoder(images))

    def hidden(self, embeds: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The LM's blocks over input embeddings at positions start.. (Transformer.hidden takes
        token ids; the image tokens have none)."""
        B, S, _ = embeds.shape
        positions = torch.arange(start, start + S, device=embeds.device).expand(B, S)
        cos, sin = self.lm.rope.cos_sin(positions)
        x = embeds
        for layer in self.lm.layers:
            x = layer(x, cos, sin, Layout())
        return self.lm.norm(x)

    def forward(self, images, input_ids, head: Head | None = None):
        """Logits (B, image_tokens + T, vocab), or `head(lm, hidden)` of the final hidden
        states over image and text positions (trainer/model.py's `Head`; the VLM recipe's
        loss pads the text labels over the image positions, trainer/vlm/recipe.py)."""
        embeds = torch.cat([self.embed_images(images), self.lm.tok_embeddings(input_ids)], 1)
        h = self.hidden(embeds)
        if head is not None:
            return head(self.lm, h)
        return nn.functional.linear(h, self.lm.output.weight).float()

    def set_stage(self, stage: str, train_encoder: bool) -> list[str]:
        """Freeze for `stage` (ALIGN: the LM, and the encoder unless train_encoder; FINETUNE:
        nothing). Returns the names of the trained parts."""
        trained = {"projector"}
        if stage == "FINETUNE" or train_encoder:
            trained.add("encoder")
        if stage == "FINETUNE":
            trained.add("lm")
        for part in ("encoder", "projector", "lm"):
            getattr(self, part).requires_grad_(part in trained)
        return sorted(trained)

    def flops_per_example(self, text_tokens: float) -> float:
        """Training FLOPs of one row: the vision encoder and projector on its image, and the LM
        on its image tokens plus `text_tokens` (trainer/sizing/flops.py, shared with plan)."""
        m, v = self.cfg.model, self.cfg.vision
        vision = flops.vision_flops_per_image(
            self.encoder.matmul_params(),
            v.n_layers,
            v.n_heads,
            v.dim // v.n_heads,
            self.encoder.grid**2,
            self.projector.matmul_params(),
            self.image_tokens,
        )
        per_token = flops.flops_per_token(
            self.lm.matmul_params(),
            m.n_layers,
            m.n_heads,
            head_dim(m),
            self.cfg.data.seq_len + self.image_tokens,
        )
        return flops.vlm_flops_per_row(vision, per_token, self.image_tokens + text_tokens)
