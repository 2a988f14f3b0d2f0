"""The kinds tests' shared base (kinds_test.py): a tiny pretraining run (8 steps), an SFT run
from its last checkpoint (8 steps), chat prompts, preference pairs and VLM scenes.

Every `kinds_*_test` starts from the same base, so Bazel builds it once, as an action
(BUILD.bazel: `kinds_base`, a tarball cached like any output), and each test unpacks it:

    make_kinds_base OUT.tar   # build the base in a temporary directory and pack it into OUT.tar

The data cache is keyed by file contents (trainer/data/cache.py), the tests name checkpoints by
path under the unpacked root, and trainer/testing.unpack_tree points the checkpoints' datasets
there.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.testing import (
    chat_file,
    pack_tree,
    sft_job,
    subprocess_env,
    tiny_job,
    train_command,
    write_job,
)
from trainer.vlm.testing import write_scenes

BASE_STEPS = 8  # of the pretraining run and of the SFT run
PRETRAINED = f"pre/checkpoints/step_{BASE_STEPS:08d}"
SFT = f"sft/checkpoints/step_{BASE_STEPS:08d}"
PREFERENCE_PAIRS = 60
SCENES = 40


def run(config: Path, run_dir: Path, faults: str = "") -> subprocess.CompletedProcess:
    """`trainer.main --config --run-dir` as a process; fails with its output's tail."""
    env = dict(subprocess_env(), KITCHEN_FAULTS=faults)
    args = train_command("--config", config, "--run-dir", run_dir)
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def build(root: Path) -> Path:
    """The base under `root` (an empty directory): pre/, sft/, cache/, chat.jsonl,
    prefs.jsonl and scenes/."""
    cache = root / "cache"
    run(write_job(root / "pre.yaml", tiny_job(cache, steps=BASE_STEPS)), root / "pre")
    chat = chat_file(root / "chat.jsonl")
    sft = sft_job(cache, chat, root / PRETRAINED, steps=BASE_STEPS)
    run(write_job(root / "sft.yaml", sft), root / "sft")
    with open(root / "prefs.jsonl", "w") as f:
        for i in range(PREFERENCE_PAIRS):
            pair = {
                "prompt": f"What is {i} plus {i}?",
                "chosen": f"{i} plus {i} is {2 * i}.",
                "rejected": f"{i} plus {i} is {2 * i + 1}",
            }
            f.write(json.dumps(pair) + "\n")
    write_scenes(root, count=SCENES)
    return root


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: make_kinds_base OUT.tar", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kinds-base-") as tmp:
        pack_tree(build(Path(tmp)), Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
