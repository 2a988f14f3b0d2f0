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

A task YAML is data unless `trainer.eval.allow_task_code` (under a launcher: set by the
launcher for the teams it trusts, docs/eval.md): lm-eval's `!function` imports and runs a
Python file, so it is refused naming the file and line, and so is an `include:` that is
absolute or climbs out with `..` (it would read any YAML on the machine, and that one's
`!function`s). The harness's own task files stay trusted (their `!function`s are its code).
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


def sandbox_templates() -> None:
    """The harness renders a task's prompts (`doc_to_text: "{{question}}"`) with a plain Jinja
    environment, in which a template reaches Python (`{{ cycler.__init__.__globals__.os }}`):
    a task YAML with no `!function` would still run code. Its environment becomes Jinja's
    sandboxed one, with the same options and filters (every harness template is plain data
    access, which the sandbox allows)."""
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval import utils

    if isinstance(utils.env, SandboxedEnvironment):
        return
    safe = SandboxedEnvironment(
        loader=utils.env.loader, undefined=utils.env.undefined, keep_trailing_newline=True
    )
    safe.filters.update(utils.env.filters)
    utils.env = safe


def local_tasks(tasks_dir: str, allow_code: bool = False) -> dict[str, dict]:
    """{task name: its config, data_files made absolute} of the shipped tasks and `tasks_dir`
    (which wins on a name both define); `allow_code`: its YAMLs may run code (see above)."""
    found: dict[str, dict] = {}
    for directory in [SHIPPED] + ([Path(tasks_dir)] if tasks_dir else []):
        if not directory.is_dir():
            raise ConfigError("trainer.eval.tasks_dir", f"{directory} is not a directory")
        trusted = allow_code or directory == SHIPPED
        for path in sorted(directory.glob("*.yaml")):
            config = _load_task_yaml(path) if trusted else _data_task_yaml(path, directory)
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


class _DataLoader(yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):  # type: ignore[misc]
    """A task YAML as data: `!function` is refused with its file and line."""


def _refuse_function(loader, node):
    where = f"{node.start_mark.name}:{node.start_mark.line + 1}"
    raise ConfigError(
        "trainer.eval.tasks_dir",
        f"{where}: `!function {node.value}` runs code from the task directory; this job may not "
        "(trainer.eval.allow_task_code, docs/eval.md)",
    )


_DataLoader.add_constructor("!function", _refuse_function)


def _data_task_yaml(path: Path, root: Path) -> dict:
    """`_load_task_yaml` for a task directory that may not run code: `!function` refused, an
    `include:` only of a file in `root` (read the same way) or of the harness's own tasks."""
    try:
        with path.open("rb") as f:
            config = yaml.load(f, Loader=_DataLoader)  # noqa: S506 - a SafeLoader
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError("trainer.eval.tasks_dir", f"{path}: not a task config: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError("trainer.eval.tasks_dir", f"{path}: not a task config (not a mapping)")
    includes = config.pop("include", [])
    merged: dict = {}
    for name in includes if isinstance(includes, list) else [includes]:
        if not isinstance(name, str) or os.path.isabs(name) or ".." in Path(name).parts:
            raise ConfigError(
                "trainer.eval.tasks_dir",
                f"{path}: include {name!r}: name a file beside it or one of the harness's own "
                "tasks (relative, no '..'): this job may not read task files elsewhere",
            )
        beside = path.parent / name
        if beside.exists() and not beside.resolve().is_relative_to(root.resolve()):
            raise ConfigError(
                "trainer.eval.tasks_dir", f"{path}: include {name!r} leads out of {root}"
            )
        if beside.exists():
            merged.update(_data_task_yaml(beside, root))
        else:
            merged.update(_load_task_yaml(_harness_tasks() / name))
    merged.pop("tag", None)
    merged.update(config)
    return merged


def task_specs(names: list[str], tasks_dir: str, allow_code: bool = False) -> list[str | dict]:
    """What the harness loads for each name: a local config, or a registered name."""
    local = local_tasks(tasks_dir, allow_code)
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
    sandbox_templates()
    specs = task_specs(list(cfg.tasks), cfg.tasks_dir, cfg.allow_task_code)
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
