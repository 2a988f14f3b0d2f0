"""Where things are on disk, for every binary: one rule each.

- `user_path(p)`: a path a person typed, made absolute from where they ran the command.
  `bazel run` changes the working directory to the runfiles; BUILD_WORKING_DIRECTORY says
  where the person was. `~` expands. "" stays "" (an unset field).
- `state_dir()`: Kitchen's state (the launcher's database, run directories, the precook
  cache): $KITCHEN_STATE_DIR, else `.state/` in the workspace (`bazel run`: the source tree,
  BUILD_WORKSPACE_DIRECTORY) or in the current directory.
- `precook_cache_dir(data, state, team)`: `data.cache_dir`, else `<state dir>/precook`, so
  `//trainer:precook` and `//trainer:train` share one cache by default; a launcher's job of a
  team gets `<state dir>/precook/<team>`.
- `image_cache_dir(state)`: `<state dir>/images`, where a launcher's image jobs unpack each
  image once (run_image.py's --cache-dir), shared by all of them.
- `run_dir_for(state, name)`: `<state dir>/runs/<name>` (`runs_dir(state)`: `<state dir>/runs`).
- `checkpoint_dirs(run_dir)`: a run's complete checkpoints, `<run_dir>/checkpoints/step_NNNNNNNN`,
  oldest first (a save writes `.tmp-*` and renames it: a `step_` directory is whole).
- `PATH_FIELDS`: the TrainerConfig fields that hold paths; `absolute_paths(cfg)` resolves them
  where the user is (submit, or the trainer run by hand), because a trainer runs elsewhere.
"""

import os
from collections.abc import Iterator
from typing import Any

# (section, field) of kitchen.v1.TrainerConfig that hold a file system path.
PATH_FIELDS: tuple[tuple[str, str], ...] = (
    ("data", "input"),
    ("data", "tokenizer_path"),
    ("data", "cache_dir"),
    ("checkpoint", "path"),
    ("rl", "preferences"),  # #14
    ("rl", "prompts"),
    ("rl", "reference_path"),
    ("rl", "reward_path"),
    ("hf", "path"),
    ("eval", "tasks_dir"),
    ("eval", "sweep"),
    ("generate", "image"),  # #16 VLM
    ("distill", "teacher_path"),  # #30
    ("serve", "api_key_file"),  # #31
    ("serve", "tls_cert"),
    ("serve", "tls_key"),
    ("serve", "draft_path"),  # #35
)
# (section, repeated message field, path field in each item): every mixture source's input.
REPEATED_PATH_FIELDS: tuple[tuple[str, str, str], ...] = (("data", "sources", "input"),)
STATE_DIR_ENV = "KITCHEN_STATE_DIR"
RUN_REF_PREFIX = "run:"  # a path field naming a run by its name: protos/run_refs.py
CHECKPOINTS_DIR = "checkpoints"  # in a run directory
CHECKPOINT_PREFIX = "step_"  # step_00000050: the checkpoint of step 50
PRECOOK_MANIFEST = "manifest.json"  # in a precooked directory (trainer/data/manifest.py)
PROFILE_DIR = "profile"  # in a run directory: trainer.profile's traces and table (#32)


def user_path(path: str) -> str:
    """An absolute path for one a person typed (see the module docstring)."""
    if not path:
        return path
    where = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
    return os.path.abspath(os.path.join(where, os.path.expanduser(path)))


def state_dir() -> str:
    """$KITCHEN_STATE_DIR, else .state/ in the workspace (`bazel run`) or the current dir."""
    if os.environ.get(STATE_DIR_ENV):
        return user_path(os.environ[STATE_DIR_ENV])
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.getcwd()
    return os.path.join(os.path.abspath(root), ".state")


def precook_cache_dir(data, state: str | None = None, team: str = "") -> str:
    """Where precooked datasets live: `data.cache_dir` (a kitchen.v1.DataConfig), else
    `<state>/precook`, and for a launcher's job of a team `<state>/precook/<team>` (a team
    never reads another's datasets)."""
    if data.cache_dir:
        return user_path(data.cache_dir)
    shared = os.path.join(state or state_dir(), "precook")
    return os.path.join(shared, team) if team else shared


def runs_dir(state: str) -> str:
    """`<state>/runs`: where every run directory of a state dir lives."""
    return os.path.join(state, "runs")


def tracking_dir(state: str) -> str:
    """`<state>/mlflow`: the embedded MLflow store (mlflow.db, artifacts/) and the launcher's
    spool of records not yet sent (spool/)."""
    return os.path.join(state, "mlflow")


def image_cache_dir(state: str) -> str:
    """`<state>/images`: the images a launcher's jobs run in, each unpacked once by
    run_image.py (keyed by manifest digest) and mounted read-only into every job of it."""
    return os.path.join(state, "images")


def run_dir_for(state: str, name: str) -> str:
    """`<state>/runs/<name>`: a job's run directory (launcher: the job id; by hand: its name)."""
    return os.path.join(runs_dir(state), name)


def checkpoint_dirs(run_dir: str) -> list[str]:
    """The complete checkpoints of the run in `run_dir`, oldest first (see the docstring)."""
    return step_dirs(os.path.join(run_dir, CHECKPOINTS_DIR))


def step_dirs(checkpoints: str) -> list[str]:
    """The complete checkpoints in directory `checkpoints` (a run's `checkpoints/`), oldest
    first: `step_` directories, never a save's `.tmp-*` one."""
    try:
        names = os.listdir(checkpoints)
    except OSError:
        return []
    names = sorted(n for n in names if n.startswith(CHECKPOINT_PREFIX))
    paths = [os.path.join(checkpoints, n) for n in names]
    return [p for p in paths if os.path.isdir(p)]


def path_fields(trainer_cfg) -> Iterator[tuple[str, Any, str]]:
    """(dotted name, message, field) of every path of a kitchen.v1.TrainerConfig: PATH_FIELDS
    and the path field of each item of REPEATED_PATH_FIELDS (`data.sources[1].input`)."""
    for section, field in PATH_FIELDS:
        yield f"{section}.{field}", getattr(trainer_cfg, section), field
    for section, repeated, field in REPEATED_PATH_FIELDS:
        for i, item in enumerate(getattr(getattr(trainer_cfg, section), repeated)):
            yield f"{section}.{repeated}[{i}].{field}", item, field


def absolute_paths(trainer_cfg) -> None:
    """Make the path fields of `trainer_cfg` (a kitchen.v1.TrainerConfig) absolute, in place.
    A run reference (`run:NAME`, protos/run_refs.py) is left for its resolver."""
    for _, message, field in path_fields(trainer_cfg):
        value = getattr(message, field)
        if not value.startswith(RUN_REF_PREFIX):
            setattr(message, field, user_path(value))
