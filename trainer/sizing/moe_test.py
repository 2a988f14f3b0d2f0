"""MoE arithmetic: the published Mixtral 8x7B and DeepSeek-V3 totals from their configurations;
the planner's active N is the trainer's Transformer.matmul_params(), so the two MFUs agree."""

import json

import pytest
import torch

from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.model import Transformer
from trainer.sizing import flops, plan


def run_json(capsys, *argv) -> dict:
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_mixtral_8x7b_is_46_7b_total_12_9b_active(capsys):
    moe = run_json(capsys, "--preset", "mixtral-8x7b", "--tokens", "1T")["moe"]
    # Announced to 0.1 B: 46.7 B and 12.9 B (46,702,792,704 and 12,879,925,248 counted here).
    assert round(moe["total"]["value"] / 1e9, 1) == 46.7
    assert round(moe["active"]["value"] / 1e9, 1) == 12.9


def test_deepseek_v3_is_671b_total_37b_active(capsys):
    p = run_json(capsys, "--preset", "deepseek-v3", "--tokens", "14.8T")
    moe = p["moe"]
    # Announced as 671 B and "37 B activated": 671.03 B and 37.55 B counted here (multi-head
    # latent attention, 3 dense layers, 58 MoE layers of 256 routed + 1 shared expert).
    assert round(moe["total"]["value"] / 1e9) == 671
    assert int(moe["active"]["value"] / 1e9) == 37
    assert p["model"]["parameters"]["value"] == moe["total"]["value"]
    # FLOPs per token from the active parameters; quoted on the total, MFU reads 18x high.
    assert moe["mfu_if_quoted_on_total"]["value"] == pytest.approx(0.4 * 18.3, rel=0.01)


def test_expert_parallelism_divides_expert_memory_and_costs_all_to_all(capsys):
    base = ["--preset", "mixtral-8x7b", "--tokens", "1T", "--gpus", "8", "--seq-len", "4096"]
    one = run_json(capsys, *base)
    eight = run_json(capsys, *base, "--expert-parallel", "8")
    routed = one["moe"]["routed_experts"]["value"]
    assert one["moe"]["all_to_all_per_step"]["value"] == 0  # every expert at home
    held = eight["moe"]["params_per_rank"]["value"]
    assert held == pytest.approx(one["moe"]["total"]["value"] - routed * 7 / 8)
    # 32 layers · 4 · top-2 · 4096 · 2 bytes · tokens per rank · 7/8.
    tokens = eight["batch"]["global_batch_tokens"]["value"] / 8
    expected = 32 * 4 * 2 * 4096 * 2 * tokens * 7 / 8
    assert eight["moe"]["all_to_all_per_step"]["value"] == pytest.approx(expected)
    ddp = eight["memory"]["model_states"]["ddp"]["total"]["value"]
    assert ddp == pytest.approx(eight["memory"]["bytes_per_param"]["total"] * held)


def test_planner_and_trainer_count_the_same_active_parameters(capsys):
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.seq_len = 64
    m = cfg.model
    m.dim, m.n_layers, m.n_heads = 64, 4, 4
    m.moe_experts, m.moe_top_k, m.moe_shared_experts, m.moe_every = 8, 2, 1, 2
    cfg = resolve_trainer(cfg)
    torch.manual_seed(0)
    model = Transformer(cfg.model, vocab_size=512)
    flags = ["--layers", "4", "--dim", "64", "--heads", "4", "--vocab", "512", "--seq-len", "64"]
    moe = ["--experts", "8", "--top-k", "2", "--shared-experts", "1", "--moe-every", "2"]
    p = run_json(capsys, *flags, *moe, "--tokens", "1M")
    assert p["model"]["non_embedding"]["value"] == model.matmul_params()
    assert p["compute"]["flops_per_token"]["value"] == flops.flops_per_token(
        model.matmul_params(), 4, 4, 16, 64
    )
    assert p["moe"]["total"]["value"] == sum(t.numel() for t in model.parameters())


def test_bad_moe_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--layers", "2", "--dim", "64", "--heads", "4", "--vocab", "512",
                   "--experts", "4", "--top-k", "5"])  # fmt: skip
    assert "--top-k: 5 is more than --experts 4" in capsys.readouterr().err
