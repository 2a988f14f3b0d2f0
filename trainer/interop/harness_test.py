"""EVAL jobs with lm-evaluation-harness tasks (offline, shipped with Kitchen) and sweeps."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from protos.progress_log import is_eval, read_progress_log
from trainer import checkpoint, main
from trainer.data.tokenizer import load_tokenizer
from trainer.interop.lm_eval_adapter import KitchenLM
from trainer.testing import tiny_job, write_job

torch.set_num_threads(1)
TASKS = ["kitchen_next_line", "kitchen_stdlib_ppl", "kitchen_complete_line"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny pretraining run with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("harness")
    job = tiny_job(tmp / "cache", steps=4, checkpoint={"every_steps": 2})
    assert (
        main.main(
            ["--config", str(write_job(tmp / "pre.yaml", job)), "--run-dir", str(tmp / "pre")]
        )
        == 0
    )
    return tmp


def eval_job(tmp, name, **eval_cfg):
    ckpt = str(tmp / "pre/checkpoints/step_00000004")
    job = {
        "name": name,
        "kind": "EVAL",
        "trainer": {"checkpoint": {"path": ckpt}, "eval": eval_cfg},
    }
    job["trainer"]["train"] = {"eval_batches": 2, "micro_batch": 4}
    config = write_job(tmp / f"{name}.yaml", job)
    return main.main(["--config", str(config), "--run-dir", str(tmp / name)])


def test_shipped_tasks_run_through_the_adapter_and_report_scores(run):
    assert eval_job(run, "tasks", tasks=TASKS, limit=6) == 0
    harness = json.loads((run / "tasks" / "eval.json").read_text())["harness"]
    assert 0 <= harness["kitchen_next_line/acc"] <= 1
    assert harness["kitchen_stdlib_ppl/word_perplexity"] > 1
    assert harness["kitchen_stdlib_ppl/bits_per_byte"] > 0
    assert 0 <= harness["kitchen_complete_line/exact_match"] <= 1
    (record,) = [p for p in read_progress_log(run / "tasks").records if is_eval(p)]
    assert record.step == 4
    reported = {(s.task, s.metric): s.value for s in record.eval_scores}
    assert reported[("kitchen_next_line", "acc")] == harness["kitchen_next_line/acc"]
    assert reported[("heldout", "loss")] == record.eval_loss


def test_adapter_scores_are_the_models_log_probabilities(run):
    """The adapter against a direct computation: log p(continuation | <bos> context)."""
    from lm_eval.api.instance import Instance

    model, meta = checkpoint.load_model(
        run / "pre/checkpoints/step_00000004", torch.device("cpu"), False
    )
    (dataset,) = (run / "cache" / "datasets").iterdir()
    tok = load_tokenizer(str(dataset))
    lm = KitchenLM(model, tok, meta.model.max_seq_len, batch_size=2)
    pairs = [("import os\n", "import sys\n"), ("def f(x):\n", "    return x\n"), ("a = ", "1")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    for (context, continuation), (score, _) in zip(pairs, lm.loglikelihood(requests), strict=True):
        ctx, whole = tok.encode(context.rstrip()), tok.encode(context + continuation)
        ids = torch.tensor([[tok.bos_id] + whole])
        with torch.no_grad():
            logp = F.log_softmax(model(ids, torch.arange(ids.shape[1])[None]), dim=-1)[0]
        expected = sum(float(logp[i, ids[0, i + 1]]) for i in range(len(ctx), len(whole)))
        assert score == pytest.approx(expected, abs=1e-4)
    # The rolling log-likelihood of a text longer than the context window (64) covers every token.
    text = "x = 1\n" * 40
    (rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert len(tok.encode(text)) > meta.model.max_seq_len and math.isfinite(rolled) and rolled < 0


def test_a_sweep_evaluates_every_checkpoint_and_plots_it(run):
    assert eval_job(run, "sweep", tasks=["kitchen_next_line"], limit=4, sweep=str(run / "pre")) == 0
    rows = json.loads((run / "sweep" / "sweep.json").read_text())
    assert [r["step"] for r in rows] == [2, 4]
    assert {"heldout/loss", "kitchen_next_line/acc"} <= set(rows[0]["scores"])
    assert (run / "sweep" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    steps = [p.step for p in read_progress_log(run / "sweep").records if is_eval(p)]
    assert steps == [2, 4]


def test_a_registered_task_runs_over_a_local_copy_of_its_data(run):
    """arc_easy's own prompt, choices and metrics (included from the harness's task files)
    over four questions in ARC's schema written here: any harness task runs offline once its
    data is on disk."""
    tasks = run / "my_tasks"
    tasks.mkdir()
    rows = [
        {"id": str(i), "question": q, "answerKey": "B",
         "choices": {"text": ["a list", "a dict", "a set"], "label": ["A", "B", "C"]}}
        for i, q in enumerate(["What maps keys to values?", "What does {} make?"] * 2)
    ]  # fmt: skip
    (tasks / "arc_easy_local.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "arc_easy_local.yaml").write_text(
        "include: arc/arc_easy.yaml\ntask: arc_easy_local\ndataset_path: json\n"
        "dataset_name: null\ndataset_kwargs:\n  data_files:\n    test: arc_easy_local.jsonl\n"
        "training_split: null\nvalidation_split: null\n"
    )
    assert eval_job(run, "arc", tasks=["arc_easy_local"], tasks_dir=str(tasks)) == 0
    harness = json.loads((run / "arc" / "eval.json").read_text())["harness"]
    assert set(harness) == {"arc_easy_local/acc", "arc_easy_local/acc_norm"}
    assert harness["arc_easy_local/acc"] in (0, 0.25, 0.5, 0.75, 1)


@pytest.mark.parametrize(
    "eval_cfg, named",
    [
        (
            {"tasks": ["kitchen_next_lines"]},
            "'kitchen_next_lines' is not a harness task (did you mean kitchen_next_line",
        ),
        ({"tasks": ["arc_easy"]}, "['arc_easy']: a task's data is not here"),  # registered
        ({"sweep": "/nonexistent/run"}, "trainer.eval.sweep: /nonexistent/run is not a directory"),
    ],
)
def test_bad_eval_input_exits_2_naming_it(run, capsys, eval_cfg, named):
    capsys.readouterr()
    assert eval_job(run, "bad", **eval_cfg) == 2
    assert named in capsys.readouterr().err


def test_a_checkpoint_that_does_not_load_exits_2_naming_it(run, capsys, tmp_path):
    broken = tmp_path / "step_00000004"
    broken.mkdir()
    (broken / "meta.json").write_text("{}")
    job = {"name": "broken", "kind": "EVAL", "trainer": {"checkpoint": {"path": str(broken)}}}
    capsys.readouterr()
    assert (
        main.main(
            ["--config", str(write_job(tmp_path / "b.yaml", job)), "--run-dir", str(tmp_path / "r")]
        )
        == 2
    )
    assert f"trainer.checkpoint.path: {broken}" in capsys.readouterr().err
