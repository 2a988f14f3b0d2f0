import json
from pathlib import Path

import pytest

from trainer.sizing import plan

LLAMA2_7B = ["--preset", "llama2-7b", "--tokens", "2T", "--seq-len", "4096"]
HARDWARE = ["--gpu", "NVIDIA H100 80GB HBM3", "--gpus", "8", "--mfu", "0.4"]


def run(capsys, *argv) -> str:
    assert plan.main(list(argv)) == 0
    return capsys.readouterr().out


def run_json(capsys, *argv) -> dict:
    return json.loads(run(capsys, *argv, "--json"))


def test_llama2_7b_numbers_by_hand(capsys):
    p = run_json(capsys, *LLAMA2_7B, *HARDWARE)
    # N = 32·202,383,360 (blocks) + 32000·4096 (output) = 6,607,339,520.
    # FLOPs/token = 6N + 12·32·32·128·4096 = 39,644,037,120 + 6,442,450,944.
    fpt = 46_086_488_064
    assert p["model"]["parameters"]["value"] == 6_738_415_616
    assert p["model"]["non_embedding"]["value"] == 6_607_339_520
    assert p["compute"]["flops_per_token"]["value"] == fpt
    assert p["compute"]["total_flops"]["value"] == pytest.approx(fpt * 2e12)
    t = p["time"]
    assert t["peak_flops_per_gpu"]["formula"].endswith("basis table:H100-SXM")
    # 9.217e22 FLOP / (8 · 989e12 · 0.4 FLOP/s) = 2.912e7 s = 337 days; × 8 GPUs = 64,718 GPU-h.
    seconds = fpt * 2e12 / (8 * 989e12 * 0.4)
    assert t["wall_clock"]["value"] == pytest.approx(seconds)
    assert t["gpu_hours"]["value"] == pytest.approx(seconds * 8 / 3600)
    assert 336 < seconds / 86400 < 338


# Llama 2 7B per s·b·h in bf16 autocast (trainer/sizing/precision.py): 2 norm inputs of the
# fp32 residual (8), 5 projections' 2-byte casts of their inputs (q, k, v, gate, up: 10),
# q, k, v and the output projection's input (8), SwiGLU's gate, up and product, 3·11008/4096
# = 8.0625 tensors (16.125).
BF16_PER_SBH = 8 + 10 + 8 + 16.125


def test_memory_and_fits(capsys):
    p = run_json(capsys, *LLAMA2_7B, *HARDWARE, "--attention", "materialized")["memory"]
    n = 6_738_415_616
    assert p["precision"] == "bf16"
    assert p["bytes_per_param"] == {
        "weights": 2,
        "gradients": 4,
        "optimizer": 8,
        "master": 4,
        "total": 18,
    }
    assert p["model_states"]["ddp"]["total"]["value"] == 18 * n
    assert p["model_states"]["zero3"]["total"]["value"] == 18 * n / 8
    # No dropout (Kitchen's blocks): + the 2-byte softmax output, a·s² per sequence.
    assert p["activations_per_layer"]["none"]["value"] == 4096 * 4096 * (BF16_PER_SBH + 2 * 32)
    assert p["activations_per_layer"]["full"]["value"] == 4 * 4096 * 4096  # fp32 residual
    by_precision = p["activations_by_precision"]
    assert list(by_precision) == ["fp32", "bf16", "fp16", "fp8"]
    assert by_precision["bf16"] == p["activations_per_layer"]["none"]["value"]
    # fp32: every element 4 bytes, one input kept per projection group: 4·(2 + 2 + 4 + 8.0625).
    fp32_per_sbh = 4 * (2 + 2 + 4 + 3 * 11008 / 4096)
    assert by_precision["fp32"] == 4096 * 4096 * (fp32_per_sbh + 4 * 32)
    # 121 GB of model states alone overflow an 80 GiB GPU under DDP; ZeRO-3 with full
    # recomputation leaves room.
    assert not any(cell["fits"] for cell in p["fits"]["ddp"].values())
    assert p["fits"]["zero3"]["full"]["fits"]


@pytest.mark.parametrize(
    "dtype, per_param, activation_bytes",
    [("fp32", (4, 4, 8, 0), 4), ("fp16", (2, 4, 8, 4), 2), ("fp8", (1, 4, 8, 4), 2)],
)
def test_each_precision_keeps_its_bytes(capsys, dtype, per_param, activation_bytes):
    args = [*LLAMA2_7B, *HARDWARE, "--dtype", dtype, "--peak-tflops", "400"]
    p = run_json(capsys, *args)["memory"]
    per = p["bytes_per_param"]
    assert (per["weights"], per["gradients"], per["optimizer"], per["master"]) == per_param
    ddp = p["model_states"]["ddp"]
    assert ddp["master"]["value"] == per_param[3] * 6_738_415_616
    assert p["activation_note"].startswith(f"{activation_bytes}-byte activations")


def test_precision_comes_from_the_configs_train_dtype(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: x\ntrainer:\n  train:\n    dtype: fp16\n")
    p = run_json(capsys, *LLAMA2_7B, *HARDWARE, "--config", str(job))
    assert p["memory"]["precision"] == "fp16"
    # The flag wins over the config.
    p = run_json(capsys, *LLAMA2_7B, *HARDWARE, "--config", str(job), "--dtype", "bf16")
    assert p["memory"]["precision"] == "bf16"
    job.write_text("name: x\ntrainer:\n  train:\n    dtype: fp12\n")
    with pytest.raises(SystemExit):
        plan.main([*LLAMA2_7B, "--config", str(job)])
    assert "--config" in capsys.readouterr().err


def test_flash_attention_stores_no_scores_by_default_on_a_gpu(capsys):
    p = run_json(capsys, *LLAMA2_7B, *HARDWARE)["memory"]
    act = p["activations_per_layer"]
    assert act["none"]["value"] == act["selective"]["value"] == BF16_PER_SBH * 4096 * 4096
    assert p["backward_transient"]["none"]["value"] == 4 * 4096 * 32000  # the logits' gradient


def test_activation_line_follows_kv_heads_and_ffn_dim(capsys):
    # The plan's own line uses the model's GQA and SwiGLU width (memory.layer_activations):
    # 8 KV heads of 32 keep K and V at a quarter each, 2·(1 − 1/4)·2 bytes less per s·b·h;
    # h more SwiGLU width adds a hidden-sized gate, up and product: 3·2 bytes per s·b·h.
    def selective(*extra):
        p = run_json(capsys, *LLAMA2_7B, *HARDWARE, *extra)["memory"]
        return p["activations_per_layer"]["selective"]["value"]

    sbh = 4096 * 4096
    assert selective() - selective("--kv-heads", "8") == sbh * 2 * (1 - 8 / 32) * 2
    assert selective("--ffn-dim", str(11008 + 4096)) - selective() == sbh * 3 * 2


def test_dropout_flag_counts_masks_and_the_papers_score_bytes(capsys):
    args = [*LLAMA2_7B, *HARDWARE, "--dropout", "--attention", "materialized"]
    p = run_json(capsys, *args)["memory"]
    assert p["activations_per_layer"]["none"]["formula"].endswith("+ 5·a·s/h")
    # Two 1-byte masks per s·b·h; per score the softmax and dropout outputs and the mask.
    expected = 4096 * 4096 * (BF16_PER_SBH + 2 + 5 * 32)
    assert p["activations_per_layer"]["none"]["value"] == expected


def test_text_output_shows_values_units_and_formulas(capsys):
    out = run(capsys, *LLAMA2_7B, *HARDWARE)
    for expected in (
        "6.74 B params",
        "46.1 GFLOP   6·N + 12·L·H·Q·T",
        "9.22e+22 FLOP",
        "989 TFLOP/s",
        "basis table:H100-SXM",
        "337.1 days",
        "ZeRO-3/FSDP",
        "42.12·s·b·h = norms 8 + inputs 10 + q,k,v,o 8 + MLP 16.1",
        "weights 2, gradients 4, optimizer 8, master 4",
        "max useful DP degree",
        "McCandlish",
    ):
        assert expected in out, expected


def test_defaults_are_stated(capsys):
    p = run_json(capsys, "--layers", "4", "--dim", "256", "--heads", "8", "--vocab", "4096")
    n = p["model"]["parameters"]["value"]
    assert p["compute"]["tokens"]["value"] == 20 * n
    assert "Chinchilla" in p["compute"]["tokens"]["formula"]
    assert p["model"]["shape"]["ffn_dim"] == 704  # the trainer's 8/3·d rounded up to 64
    assert p["model"]["shape"]["tie_embeddings"] is True  # the trainer's default


def test_cpu_peak_is_measured(capsys):
    args = ["--layers", "2", "--dim", "64", "--heads", "4", "--vocab", "512", "--gpu", "cpu"]
    p = run_json(capsys, *args, "--gpus", "1", "--seq-len", "64", "--tokens", "1M")
    assert p["time"]["peak_flops_per_gpu"]["formula"] == "fp32 dense peak, basis measured"
    assert p["time"]["peak_flops_per_gpu"]["value"] > 0
    assert p["memory"]["precision"] == "fp32"


def test_unknown_accelerator_with_given_peak_and_memory(capsys):
    args = [*LLAMA2_7B, "--gpu", "Tesla V100", "--peak-tflops", "125", "--memory-gib", "32"]
    p = run_json(capsys, *args)
    assert p["time"]["peak_flops_per_gpu"]["value"] == 125e12
    assert p["memory"]["device_memory"]["value"] == 32 * 2**30


def test_batch_guidance(capsys):
    p = run_json(capsys, *LLAMA2_7B, *HARDWARE, "--global-batch", "512", "--micro-batch", "4")
    b = p["batch"]
    assert b["global_batch_tokens"]["value"] == 512 * 4096
    assert b["max_data_parallel"]["value"] == 128
    assert b["grad_accumulation"]["value"] == 16
    assert b["warnings"] == []
    p = run_json(capsys, *LLAMA2_7B, "--gpus", "256", "--global-batch", "128")
    assert "idle" in p["batch"]["warnings"][0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "4", "--dim", "256", "--heads", "6", "--vocab", "9"], "--heads: 6 does not"),
        (["--layers", "4", "--heads", "8", "--vocab", "9"], "--dim: required"),
        (["--preset", "llama2-7b", "--kv-heads", "5"], "--kv-heads: 5 does not divide"),
        (["--preset", "llama2-7b", "--mfu", "40"], "--mfu: 40 is not a fraction in (0, 1]"),
        (["--preset", "llama2-7b", "--gpu", "V100"], "--gpu: 'V100' is not in the table"),
        (["--preset", "llama2-7b", "--tokens", "lots"], "--tokens: 'lots' is not a count"),
        (["--preset", "llama2-7b", "--gpus", "0"], "--gpus: 0 must be positive"),
        (["--preset", "llama2-7b", "--global-batch", "1", "--micro-batch", "2"], "--global-batch"),
        (["--preset", "llama2-7b", "--dtype", "fp32"], "--peak-tflops: required"),
    ],
)
def test_bad_input_names_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_readme_worked_example_is_the_cli_output(capsys):
    # The README's example is pasted CLI output; it must still be what the CLI prints.
    readme = (Path(__file__).parent / "README.md").read_text()
    block = readme.split("$ ./bazel run //trainer:plan -- ", 1)[1].split("\n```", 1)[0]
    lines = block.split("\n")
    argv_lines = [lines[0]]
    while argv_lines[-1].endswith("\\"):
        argv_lines.append(lines[len(argv_lines)])
    argv = " ".join(line.rstrip("\\") for line in argv_lines).split()
    expected = "\n".join(lines[len(argv_lines) :])
    assert expected.startswith("Plan for") and "BATCH" in expected
    assert run(capsys, *argv).rstrip() == expected.rstrip()
