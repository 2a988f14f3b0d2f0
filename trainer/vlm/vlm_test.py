"""A VLM end to end through `train`, small enough for CI: synthetic scenes, precook, a
fine-tuning stage from scratch, then the held-out evaluation that shows the answers come from
the image (color well above chance and the blank image), EVAL of the checkpoint, generate with
an image, and bad configs refused with the field named."""

import json

import pytest
import torch

from protos.exit_codes import ExitCode
from trainer import main
from trainer.testing import write_job
from trainer.vlm import scenes
from trainer.vlm.testing import vlm_job, write_scenes

torch.set_num_threads(1)
STEPS = 120


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    write_scenes(root)
    job = write_job(root / "job.yaml", vlm_job(root, steps=STEPS))
    code = main.main(["--config", str(job), "--run-dir", str(root / "run")])
    return code, root


def test_color_is_read_off_the_image(trained):
    code, root = trained
    assert code == ExitCode.OK
    report = json.loads((root / "run" / "vlm_eval.json").read_text())
    color = report["per_type"]["color"]
    assert color["questions"] >= 40
    assert color["chance"] == pytest.approx(1 / len(scenes.COLORS))
    assert color["accuracy"] >= 0.8, report
    assert color["blank_image_accuracy"] <= color["chance"] + 0.2, report
    log = (root / "run" / "train.log").read_text()
    assert "4 image tokens per image" in log and "MFU" in log and "held-out answer accuracy" in log


def test_eval_job_of_the_checkpoint_gives_the_same_report(trained):
    _, root = trained
    job = write_job(root / "eval.yaml", vlm_job(root, kind="EVAL"))
    assert main.main(["--config", str(job), "--run-dir", str(root / "run")]) == ExitCode.OK
    again = json.loads((root / "run" / "vlm_eval.json").read_text())
    assert again["per_type"]["color"]["questions"] >= 40


def test_generate_answers_about_the_given_image(trained, capsys):
    _, root = trained
    line = next(
        json.loads(s)
        for s in (root / "scenes" / "scenes.jsonl").read_text().splitlines()
        if json.loads(s)["type"] == "color"
    )
    prompt = line["prompt"]
    gen = {
        "image": str(root / "scenes" / line["image"]),
        "prompt": prompt,
        "temperature": 0,
        "max_new_tokens": 3,
    }
    job = write_job(root / "gen.yaml", vlm_job(root, kind="GENERATE", generate=gen))
    capsys.readouterr()
    assert main.main(["--config", str(job), "--run-dir", str(root / "run")]) == ExitCode.OK
    said = [s for s in capsys.readouterr().out.splitlines() if s.startswith(prompt)]
    assert len(said) == 1
    assert said[0][len(prompt) :].strip() == line["response"].strip()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"data": {"format": "JSONL"}}, "trainer.data.format"),
        ({"vision": {"patch_size": 5}}, "trainer.vision.patch_size"),
        ({"vision": {"pixel_shuffle": 3}}, "trainer.vision.pixel_shuffle"),
        ({"generate": {"image": "/no/such.png"}}, "trainer.generate.image"),
    ],
)
def test_bad_configs_exit_2_naming_the_field(trained, tmp_path, capsys, change, field):
    _, root = trained
    kind = "GENERATE" if "generate" in change else "VLM"
    job = write_job(tmp_path / "bad.yaml", vlm_job(root, kind=kind, **change))
    assert main.main(["--config", str(job), "--run-dir", str(root / "run")]) == ExitCode.BAD_CONFIG
    assert field in capsys.readouterr().err


def test_a_text_job_given_the_vlm_checkpoint_exits_2_naming_it(trained, capsys):
    """Without the image data and vision section (here: text generate), the checkpoint is
    refused by name, not half-loaded into a text model."""
    _, root = trained
    path = sorted((root / "run" / "checkpoints").glob("step_*"))[-1]
    job = vlm_job(root, kind="GENERATE", data={"format": "JSONL"}, checkpoint={"path": str(path)})
    job["trainer"]["generate"] = {"prompt": "question:", "max_new_tokens": 2}
    config = write_job(root / "text_gen.yaml", job)
    assert main.main(["--config", str(config)]) == ExitCode.BAD_CONFIG
    err = capsys.readouterr().err
    assert "trainer.checkpoint.path" in err and "is a VLM checkpoint" in err
