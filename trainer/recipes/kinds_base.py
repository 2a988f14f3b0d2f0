"""The kinds tests' shared base (kinds_test.py): a tiny pretraining run (8 steps), an SFT run
from its last checkpoint (8 steps), chat prompts, preference pairs and VLM scenes.

Every `kinds_*_test` starts from the same base, so Bazel builds it once, as an action
(BUILD.bazel: `kinds_base`, a tarball cached like any output), and each test unpacks it:

    kinds_base OUT.tar   # build the base in a temporary directory and pack it into OUT.tar

Nothing in the base depends on where it was built: the data cache is keyed by file contents
(trainer/data/cache.py) and the tests name the checkpoints by path under the unpacked root.
"""

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from protos import files
from trainer.testing import (
    chat_file,
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


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """No owner or time in the archive: the same files give the same bytes."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def pack(root: Path, out: Path) -> None:
    """`root`'s files into the tarball `out` (sorted, relative names), written atomically."""
    data = io.BytesIO()  # a few MB
    with tarfile.open(fileobj=data, mode="w") as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                tar.add(path, arcname=str(path.relative_to(root)), filter=_normalized)
    files.write_atomic(str(out), data.getvalue())


def unpack(tarball: Path, root: Path) -> Path:
    """The base packed in `tarball`, under `root`. A checkpoint's meta.json names the dataset
    it was trained on by absolute path (its tokenizer is read from there): each is pointed at
    the same dataset under `root`."""
    with tarfile.open(tarball) as tar:
        tar.extractall(root, filter="data")
    for meta_path in sorted(root.glob("*/checkpoints/*/meta.json")):
        meta = json.loads(meta_path.read_text())
        dataset = root / "cache" / "datasets" / Path(meta["dataset"]).name
        if not dataset.is_dir():
            raise FileNotFoundError(
                f"{meta_path}: its dataset {meta['dataset']} is not in {tarball}"
            )
        meta["dataset"] = str(dataset)
        files.write_atomic(str(meta_path), files.json_bytes(meta))
    return root


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: kinds_base OUT.tar", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kinds-base-") as tmp:
        pack(build(Path(tmp)), Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
