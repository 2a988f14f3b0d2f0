"""The VLM's parts: pixel shuffle, image tokens, stages, and the vision FLOPs formula."""

import pytest
import torch

from protos import job_pb2, trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.sizing import flops
from trainer.vlm.model import VisionLanguageModel, image_tokens
from trainer.vlm.projector import pixel_shuffle


def config(**vision) -> trainer_config_pb2.TrainerConfig:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.format = trainer_config_pb2.JSONL_IMAGE
    cfg.data.seq_len = 8
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 32, 1, 2
    cfg.vision.dim, cfg.vision.n_layers, cfg.vision.n_heads = 16, 1, 2
    for k, v in vision.items():
        setattr(cfg.vision, k, v)
    return resolve_trainer(cfg, job_pb2.VLM)


def test_pixel_shuffle_folds_each_block_of_neighbours_into_one_token():
    grid, r, d = 4, 2, 3
    x = torch.arange(grid * grid * d, dtype=torch.float32).view(1, grid * grid, d)
    out = pixel_shuffle(x, grid, r)
    assert out.shape == (1, 4, r * r * d)
    # token 1 is the top-right 2x2 block: patches (0,2), (0,3), (1,2), (1,3) in row-major order
    block = [x[0, p] for p in (2, 3, 6, 7)]
    assert torch.equal(out[0, 1], torch.cat(block))


def test_image_tokens_follow_patch_grid_and_shuffle():
    assert image_tokens(config(image_size=32, patch_size=4, pixel_shuffle=2)) == 16
    assert image_tokens(config(image_size=32, patch_size=4, pixel_shuffle=4)) == 4
    with pytest.raises(Exception, match="pixel_shuffle"):
        config(image_size=32, patch_size=4, pixel_shuffle=3)


def test_the_image_changes_the_answer_and_stages_freeze_what_they_say():
    cfg = config()
    model = VisionLanguageModel(cfg, 300, torch.device("cpu"))
    ids = torch.randint(0, 300, (2, 8))
    a = torch.zeros(2, 32, 32, 3, dtype=torch.uint8)
    b = torch.full((2, 32, 32, 3), 200, dtype=torch.uint8)
    assert not torch.allclose(model(a, ids)[:, -1], model(b, ids)[:, -1])
    assert model(a, ids).shape == (2, 16 + 8, 300)
    assert model.set_stage("ALIGN", False) == ["projector"]
    assert not any(p.requires_grad for p in model.lm.parameters())
    assert not any(p.requires_grad for p in model.encoder.parameters())
    assert model.set_stage("ALIGN", True) == ["encoder", "projector"]
    assert model.set_stage("FINETUNE", False) == ["encoder", "lm", "projector"]
    assert all(p.requires_grad for p in model.parameters())


def test_vision_flops_count_the_encoder_on_every_patch_and_the_projector_per_token():
    cfg = config()
    model = VisionLanguageModel(cfg, 300, torch.device("cpu"))
    v = cfg.vision
    patches = (v.image_size // v.patch_size) ** 2
    enc = model.encoder.matmul_params()
    # by hand: per patch 6N + 12·L·H·Q·P, over P patches; projector 6·N per image token
    by_hand = (
        patches * (6 * enc + 12 * 1 * 2 * 8 * patches) + 6 * model.projector.matmul_params() * 16
    )
    got = flops.vision_flops_per_image(enc, 1, 2, 8, patches, model.projector.matmul_params(), 16)
    assert got == by_hand
    lm_token = flops.flops_per_token(model.lm.matmul_params(), 1, 2, 16, 8 + 16)
    assert model.flops_per_example(5) == pytest.approx(got + lm_token * (16 + 5))


def test_the_planner_counts_the_vlm_as_the_trainer_does():
    """trainer/sizing's parameter count of the encoder and projector is the model's, and a
    plan's FLOPs per token for a full row are the trainer's (one formula for both)."""
    from trainer.sizing import plan
    from trainer.sizing.params import vision_matmul_params

    cfg = config()
    model = VisionLanguageModel(cfg, 300, torch.device("cpu"))
    v, m = cfg.vision, cfg.model
    counted = vision_matmul_params(
        v.image_size, v.patch_size, v.dim, v.n_layers, v.pixel_shuffle, m.dim
    )
    assert counted == (model.encoder.matmul_params(), model.projector.matmul_params())
    T = cfg.data.seq_len + model.image_tokens
    args = plan.build_parser().parse_args(
        f"--layers 1 --dim 32 --heads 2 --vocab 300 --seq-len {T} --gpu cpu --gpus 1 "
        f"--tokens 1M --image-size {v.image_size} --patch-size {v.patch_size} "
        f"--vision-dim {v.dim} --vision-layers {v.n_layers} --vision-heads {v.n_heads} "
        f"--pixel-shuffle {v.pixel_shuffle}".split()
    )
    planned = plan.make_plan(args).compute.flops_per_token.value
    assert planned == pytest.approx(model.flops_per_example(cfg.data.seq_len) / T)
