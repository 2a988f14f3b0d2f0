"""lm-evaluation-harness tasks for EVAL jobs, offline.

A task name in `trainer.eval.tasks` is looked up in order:
1. the shipped tasks (trainer/interop/tasks/*.yaml) and those of `trainer.eval.tasks_dir`:
   YAML task configs whose `dataset_kwargs.data_files` are paths relative to the YAML file
   (resolved here, so a task directory can live anywhere). A YAML may `include:` one of the
   harness's own task files (`arc/arc_easy.yaml`) and point it at local data: any registered
   task runs over a local copy of its dataset;
2. the harness's registry (`hellaswag`, `arc_easy`, ...): it runs when its dataset is already
   in the Hugging Face datasets cache; nothing is downloaded (HF_DATASETS_OFFLINE=1).
An unknown name, or a registered task whose data is not on this machine, is a ConfigError
naming `trainer.eval.tasks` and the task: the trainer exits 2.
"""

import difflib
import functools
import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from protos.config_yaml import ConfigError
from protos.trainer_config_pb2 import EvalConfig

SHIPPED = Path(__file__).parent / "tasks"
FIELD = "trainer.eval.tasks"
NOT_SCORES = {"sample_len", "alias"}  # bookkeeping the harness puts beside the metrics
BINARY = {"acc", "acc_norm", "exact_match"}  # means of 0/1 outcomes


@dataclass(frozen=True)
class TaskScore:
    task: str
    metric: str  # "acc", "word_perplexity", ... (the harness's filter suffix dropped)
    value: float
    stderr: float  # NaN where the harness gives none


def offline() -> None:
    """No hub at run time: the harness and datasets read local files only."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


def local_tasks(tasks_dir: str) -> dict[str, dict]:
    """{task name: its config, data_files made absolute} of the shipped tasks and `tasks_dir`
    (which wins on a name both define)."""
    found: dict[str, dict] = {}
    for directory in [SHIPPED] + ([Path(tasks_dir)] if tasks_dir else []):
        if not directory.is_dir():
            raise ConfigError("trainer.eval.tasks_dir", f"{directory} is not a directory")
        for path in sorted(directory.glob("*.yaml")):
            config = _load_task_yaml(path)
            if "task" not in config:
                continue
            files = config.get("dataset_kwargs", {}).get("data_files")
            if isinstance(files, dict):
                config["dataset_kwargs"]["data_files"] = {
                    split: str(path.parent / f) for split, f in files.items()
                }
            found[str(config["task"])] = config
    return found


@functools.cache
def registry():
    """The harness's TaskManager over its own ~15,000 task configs (seconds to index: only
    built when a task is not a local one)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _harness_tasks() -> Path:
    """The harness's own task directory (lm_eval/tasks)."""
    spec = importlib.util.find_spec("lm_eval")
    assert spec is not None and spec.origin is not None, "lm-eval is not installed"
    return Path(spec.origin).parent / "tasks"


def _load_task_yaml(path: Path) -> dict:
    """A task YAML as the harness reads it (`!function`, `include`), where an `include` that is
    not beside the file names one of the harness's own task files (`include:
    arc/arc_easy.yaml`): a registered task's prompts and metrics over local data."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(path, recursive=False)
        includes = config.pop("include", [])
        merged: dict = {}
        for name in includes if isinstance(includes, list) else [includes]:
            beside = path.parent / name
            merged.update(load_yaml(beside if beside.exists() else _harness_tasks() / name))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError("trainer.eval.tasks_dir", f"{path}: not a task config: {e}") from e
    merged.pop("tag", None)  # a local variant is not a member of the registered task's tags
    merged.update(config)
    return merged


def task_specs(names: list[str], tasks_dir: str) -> list[str | dict]:
    """What the harness loads for each name: a local config, or a registered name."""
    local = local_tasks(tasks_dir)
    specs: list[str | dict] = []
    for name in names:
        if name in local:
            specs.append(local[name])
            continue
        registered = registry().all_tasks
        if name not in registered:
            close = difflib.get_close_matches(name, [*local, *registered], n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                FIELD,
                f"{name!r} is not a harness task{hint}; shipped offline tasks: "
                + ", ".join(sorted(local)),
            )
        specs.append(name)
    return specs


def run_tasks(lm, cfg: EvalConfig) -> list[TaskScore]:
    """Every task of `cfg.tasks` on `lm` (a harness LM); scores in task order."""
    offline()
    specs = task_specs(list(cfg.tasks), cfg.tasks_dir)
    local_only = all(isinstance(s, dict) for s in specs)
    with tempfile.TemporaryDirectory(prefix="kitchen-harness-") as scratch:
        for spec in specs:  # local data: its Arrow cache is scratch, not ~/.cache (read-only?)
            if isinstance(spec, dict):
                spec.setdefault("dataset_kwargs", {})["cache_dir"] = scratch
        return _evaluate(lm, cfg, specs, local_only)


def _evaluate(lm, cfg: EvalConfig, specs: list[str | dict], local_only: bool) -> list[TaskScore]:
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    try:
        results = simple_evaluate(
            model=lm,
            tasks=specs,
            task_manager=TaskManager(include_defaults=False) if local_only else registry(),
            limit=cfg.limit or None,
            bootstrap_iters=0,
            log_samples=False,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
    except (ConnectionError, OSError, ValueError) as e:  # offline datasets: data not cached
        raise ConfigError(FIELD, f"{list(cfg.tasks)}: a task's data is not here: {e}") from e
    assert results is not None  # rank 0 (the harness returns None on other ranks)
    return scores_of(results["results"])


def scores_of(results: dict) -> list[TaskScore]:
    """The harness's {task: {"acc,none": x, "acc_stderr,none": s, "sample_len": n, ...}} as
    TaskScores. Bootstrapping is off (it forks a process pool): the standard error of a
    0..1 mean (acc, exact_match) is the binomial one, sqrt(p (1 - p) / n); others have none."""
    out = []
    for task, metrics in results.items():
        n = metrics.get("sample_len") or 0
        for key, value in metrics.items():
            metric, _, _ = key.partition(",")
            if metric.endswith("_stderr") or metric in NOT_SCORES or not _number(value):
                continue
            stderr = metrics.get(key.replace(metric, f"{metric}_stderr", 1))
            if not _number(stderr):
                binary = metric in BINARY and n and 0 <= value <= 1
                stderr = math.sqrt(value * (1 - value) / n) if binary else math.nan
            out.append(TaskScore(task, metric, float(value), float(stderr)))
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
