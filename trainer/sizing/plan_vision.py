"""plan's vision flags (#16: a VLM, one image at the start of every sequence) and the FLOPs
they add (the formulas: flops.vision_flops_per_image, params.vision_matmul_params)."""

import argparse

from trainer.sizing import flops
from trainer.sizing.params import vision_matmul_params
from trainer.sizing.plan_flags import PlanError


def add_flags(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group("vision (#16: a VLM, one image at the start of every sequence)")
    v.add_argument("--image-size", type=int, help="pixels, square (sets a VLM plan)")
    v.add_argument("--patch-size", type=int, default=16, help="ViT patch (16)")
    v.add_argument("--vision-dim", type=int, default=768, help="encoder width (768)")
    v.add_argument("--vision-layers", type=int, default=12, help="encoder layers (12)")
    v.add_argument("--vision-heads", type=int, default=12, help="encoder heads (12)")
    v.add_argument("--pixel-shuffle", type=int, default=1, help="image tokens cut by its square")


def flops_per_row(a: argparse.Namespace, lm_dim: int, lm_fpt: float, T: int) -> float:
    """#16: FLOPs of one VLM sequence of T positions, one image's tokens among them."""
    grid = a.image_size // max(a.patch_size, 1)
    if a.patch_size <= 0 or a.image_size % a.patch_size or grid % max(a.pixel_shuffle, 1):
        raise PlanError(
            f"--patch-size: {a.patch_size} must divide --image-size {a.image_size} into a grid "
            f"that --pixel-shuffle {a.pixel_shuffle} divides"
        )
    if a.vision_heads <= 0 or a.vision_dim % a.vision_heads:
        raise PlanError(f"--vision-heads: {a.vision_heads} does not divide {a.vision_dim}")
    image_tokens = (grid // a.pixel_shuffle) ** 2
    if image_tokens >= T:
        raise PlanError(f"--seq-len: {T} leaves no room after {image_tokens} image tokens")
    encoder, projector = vision_matmul_params(
        a.image_size, a.patch_size, a.vision_dim, a.vision_layers, a.pixel_shuffle, lm_dim
    )
    vision = flops.vision_flops_per_image(
        encoder,
        a.vision_layers,
        a.vision_heads,
        a.vision_dim // a.vision_heads,
        grid * grid,
        projector,
        image_tokens,
    )
    return flops.vlm_flops_per_row(vision, lm_fpt, T)
