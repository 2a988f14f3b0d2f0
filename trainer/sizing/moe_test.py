"""MoE arithmetic: the published Mixtral 8x7B, DeepSeek-V3 and Qwen3-30B-A3B totals from their
configurations; the planner's active N is the trainer's Transformer.matmul_params(), so the two
MFUs agree."""

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


def test_qwen3_30b_a3b_is_30_53b_total_3_35b_active(capsys):
    """Its config.json: 48 layers, dim 2048, 32 query heads and 4 key/value heads of 128 (not
    2048/32 = 64), 128 experts of 768, top-8, vocabulary 151,936, untied. Announced as 30.5 B
    and 3.3 B; its config's tensors, counted by hand, are 30,532,122,624 and 3,353,032,704,
    with per-head q/k norms (48 · 2 · 128 = 12,288) that Kitchen's model does not have and
    the plan leaves out. Without head_dim the plan said 30.08 B / 2.90 B."""
    p = run_json(capsys, "--preset", "qwen3-30b-a3b", "--tokens", "1T")
    moe = p["moe"]
    assert moe["total"]["value"] == 30_532_122_624 - 12_288
    assert moe["active"]["value"] == 3_353_032_704 - 12_288
    assert p["model"]["shape"]["head_dim"] == 128
    flags = ["--layers", "48", "--dim", "2048", "--heads", "32", "--kv-heads", "4"]
    flags += ["--vocab", "151936", "--experts", "128", "--top-k", "8", "--expert-ffn-dim", "768"]
    flags += ["--tokens", "1T", "--ffn-dim", "6144", "--no-tie-embeddings"]
    assert run_json(capsys, *flags, "--head-dim", "128")["moe"] == moe  # the flags, by hand
    assert round(run_json(capsys, *flags)["moe"]["active"]["value"] / 1e9, 2) == 2.90


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


@pytest.mark.parametrize(
    "extra",
    [
        {},
        # heads wider than dim / heads, and dense first layers (Qwen3's, DeepSeek-V3's fields)
        {"head_dim": 24, "moe_first_dense": 2, "moe_every": 1},
    ],
)
def test_planner_and_trainer_count_the_same_active_parameters(capsys, extra):
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.seq_len = 64
    m = cfg.model
    m.dim, m.n_layers, m.n_heads = 64, 4, 4
    m.moe_experts, m.moe_top_k, m.moe_shared_experts, m.moe_every = 8, 2, 1, 2
    for field, value in extra.items():
        setattr(m, field, value)
    cfg = resolve_trainer(cfg)
    m = cfg.model
    torch.manual_seed(0)
    model = Transformer(m, vocab_size=512)
    flags = ["--layers", "4", "--dim", "64", "--heads", "4", "--vocab", "512", "--seq-len", "64"]
    flags += ["--head-dim", str(m.head_dim), "--first-dense", str(m.moe_first_dense)]
    moe = ["--experts", "8", "--top-k", "2", "--shared-experts", "1"]
    p = run_json(capsys, *flags, *moe, "--moe-every", str(m.moe_every), "--tokens", "1M")
    assert p["model"]["non_embedding"]["value"] == model.matmul_params()
    assert p["compute"]["flops_per_token"]["value"] == flops.flops_per_token(
        model.matmul_params(), 4, 4, m.head_dim, 64
    )
    assert p["moe"]["total"]["value"] == sum(t.numel() for t in model.parameters())
    # the model runs with it: logits of the vocabulary's width
    logits = model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None])
    assert logits.shape == (1, 8, 512)


def test_bad_moe_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--layers", "2", "--dim", "64", "--heads", "4", "--vocab", "512",
                   "--experts", "4", "--top-k", "5"])  # fmt: skip
    assert "--top-k: 5 is more than --experts 4" in capsys.readouterr().err
