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


def test_memory_and_fits(capsys):
    p = run_json(capsys, *LLAMA2_7B, *HARDWARE, "--attention", "materialized")["memory"]
    n = 6_738_415_616
    assert p["layout"] == "mixed"
    assert p["model_states"]["ddp"]["total"]["value"] == 16 * n
    assert p["model_states"]["zero3"]["total"]["value"] == 2 * n  # 16·N / 8 GPUs
    # No dropout (Kitchen's blocks), bf16: s·b·h·(32 + 2·a·s/h) = 4096·4096·(32 + 64).
    assert p["activations_per_layer"]["none"]["value"] == 4096 * 4096 * 96
    assert p["activations_per_layer"]["full"]["value"] == 2 * 4096 * 4096
    # 107.8 GB of model states alone overflow an 80 GiB GPU under DDP; ZeRO-3 with full
    # recomputation leaves room.
    assert not any(cell["fits"] for cell in p["fits"]["ddp"].values())
    assert p["fits"]["zero3"]["full"]["fits"]


def test_flash_attention_stores_no_scores_by_default_on_a_gpu(capsys):
    p = run_json(capsys, *LLAMA2_7B, *HARDWARE)["memory"]
    act = p["activations_per_layer"]
    assert act["none"]["value"] == act["selective"]["value"] == 32 * 4096 * 4096
    assert p["backward_transient"]["none"]["value"] == 4 * 4096 * 32000  # the logits' gradient


def test_dropout_flag_gives_the_papers_constants(capsys):
    args = [*LLAMA2_7B, *HARDWARE, "--dropout", "--attention", "materialized"]
    p = run_json(capsys, *args)["memory"]
    assert p["activations_per_layer"]["none"]["formula"] == "s·b·h·(34 + 5·a·s/h)"
    assert p["activations_per_layer"]["selective"]["formula"] == "34·s·b·h"
    assert p["activations_per_layer"]["none"]["value"] == 4096 * 4096 * (34 + 5 * 32)


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
        "32·s·b·h (flash: no a·s² scores)",
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
    assert p["memory"]["layout"] == "fp32"


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
