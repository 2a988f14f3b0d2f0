"""Test helpers: a tiny job on a small real corpus, and the trainer run as a real process."""

import io
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from protos import files
from protos.progress_log import is_training_step, read_progress_log


def stdlib_package(name: str = "email") -> str:
    """A directory of the standard library: real Python text, a few hundred KB."""
    return os.path.join(sysconfig.get_paths()["stdlib"], name)


def tiny_job(cache_dir, *, kind="PRETRAIN", steps=8, **sections) -> dict:
    """A YAML-shaped job: a 2-layer model on seq 64 rows of a stdlib package. `sections`
    update the trainer sections, e.g. train={"grad_accum": 2}."""
    trainer: dict[str, dict[str, Any]] = {
        "data": {
            "input": stdlib_package(),
            "vocab_size": 512,
            "seq_len": 64,
            "eval_fraction": 0.1,
            "cache_dir": str(cache_dir),
            "workers": 1,
        },
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": steps, "micro_batch": 4, "log_every": 1, "eval_every": 0},
        "checkpoint": {"every_steps": 4},
    }
    for section, fields in sections.items():
        trainer.setdefault(section, {}).update(fields)
    return {"name": "tiny-test", "kind": kind, "trainer": trainer}


def chat_file(path, n=200) -> Path:
    """JSONL_CHAT pairs "What is i plus i?" -> "i plus i is 2i." (SFT and RLHF tests)."""
    with open(path, "w") as f:
        for i in range(n):
            pair = {"prompt": f"What is {i} plus {i}?", "response": f"{i} plus {i} is {2 * i}."}
            f.write(json.dumps(pair) + "\n")
    return Path(path)


def sft_job(cache_dir, chat: Path, pretrained: Path, *, steps=8) -> dict:
    """tiny_job's SFT on `chat` (chat_file) from checkpoint `pretrained` of a tiny_job
    pretraining run, with that run's tokenizer (the only dataset in `cache_dir`)."""
    (dataset,) = (Path(cache_dir) / "datasets").iterdir()
    job = tiny_job(cache_dir, kind="SFT", steps=steps)
    job["trainer"]["checkpoint"] = {"path": str(pretrained)}  # saved at the end only
    job["trainer"]["data"].update(
        input=str(chat),
        format="jsonl_chat",
        tokenizer="bpe_file",
        tokenizer_path=str(dataset / "tokenizer.json"),
        eval_fraction=0.05,
    )
    return job


BUILT_AT = ".built_at"  # in a fixture tarball: the directory it was packed from


def _ownerless(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack_tree(root: Path, out: Path) -> None:
    """`root` (a fixture trained once by a Bazel action) into the tarball `out`, written
    atomically: sorted names, no owner, mtimes kept (run references order runs by them), and
    `root` itself in BUILT_AT, for unpack_tree."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        tar.add(root, arcname=".", filter=_ownerless)  # tarfile adds a directory's names sorted
        built_at = tarfile.TarInfo(BUILT_AT)
        path = os.path.abspath(root).encode()
        built_at.size = len(path)
        tar.addfile(_ownerless(built_at), io.BytesIO(path))
    files.write_atomic(str(out), data.getvalue())


def unpack_tree(tarball: Path, root: Path) -> Path:
    """pack_tree's tarball under `root`. A checkpoint's meta.json names the dataset it was
    trained on by absolute path (its tokenizer is read from there): each under the packed
    directory is pointed at the same dataset under `root`."""
    with tarfile.open(tarball) as tar:
        tar.extractall(root, filter="data")
    built_at = (root / BUILT_AT).read_text()
    for meta_path in sorted(root.glob("**/checkpoints/*/meta.json")):
        meta = json.loads(meta_path.read_text())
        rel = os.path.relpath(meta["dataset"], built_at)
        if rel.startswith(".."):
            raise ValueError(f"{meta_path}: its dataset {meta['dataset']} is not in {tarball}")
        meta["dataset"] = str(root / rel)
        packed = meta_path.parent.stat()  # run references order checkpoints by mtime
        files.write_atomic(str(meta_path), files.json_bytes(meta))
        os.utime(meta_path.parent, ns=(packed.st_atime_ns, packed.st_mtime_ns))
    return root


def write_job(path, job: dict) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(job))
    return path


def write_attempt(path, job: dict, run_dir, **fields) -> Path:
    """A launcher's handoff (kitchen.v1.Attempt as JSON) for `job`: what `train --attempt`
    reads. `fields` set the Attempt's own fields (job_id, number, launcher, token_file, ...)."""
    from google.protobuf import json_format

    from protos import attempt_pb2
    from protos.config_yaml import job_spec_from_dict

    spec = job_spec_from_dict(job)
    attempt = attempt_pb2.Attempt(spec=spec, run_dir=str(run_dir), **fields)
    attempt.cache_dir = spec.trainer.data.cache_dir
    path = Path(path)
    path.write_text(json_format.MessageToJson(attempt))
    return path


def subprocess_env() -> dict:
    """This interpreter's import path, one thread per process (runs must compare bitwise)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def train_command(*args) -> list[str]:
    return [sys.executable, "-m", "trainer.main", *map(str, args)]


def start_trainer(*args, log_path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            train_command(*args), env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT
        )


def run_trainer(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(*args), env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )


def wait_for_step(run_dir, step: int, process: subprocess.Popen, timeout=60.0) -> int:
    """Poll metrics.jsonl until a train record reaches `step`; the step seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            records = read_progress_log(run_dir).records
        except FileNotFoundError:  # no line written yet
            records = []
        steps = [r.step for r in records if r.phase == "train"]
        if steps and max(steps) >= step:
            return max(steps)
        if process.poll() is not None:
            raise AssertionError(f"trainer exited with {process.returncode} before step {step}")
        time.sleep(0.01)
    raise AssertionError(f"no step {step} within {timeout} s")


def train_losses(run_dir) -> list[tuple[int, float]]:
    """(step, loss) of every logged train step, in the order written (repeats included)."""
    return [(r.step, r.loss) for r in read_progress_log(run_dir).records if is_training_step(r)]


def final_weights(run_dir) -> dict:
    newest = sorted((Path(run_dir) / "checkpoints").glob("step_*"))[-1]
    return torch.load(newest / "model.pt", map_location="cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(job, run_dir, nproc: int = 2) -> subprocess.CompletedProcess:
    """`trainer.main --config job` under torchrun with `nproc` processes (gloo on 127.0.0.1)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "trainer.main",
        "--config",
        str(job),
        "--run-dir",
        str(run_dir),
    ]
    env = dict(subprocess_env(), GLOO_SOCKET_IFNAME="lo")
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240 * nproc)


MOE_STEPS = 6  # of the jobs of moe_job


def moe_job(root, name: str, balance: str, model: dict, **train) -> Path:
    """A tiny MoE job written to `root/<name>.yaml`: MOE_STEPS steps at a constant learning rate
    (so a resumed run takes the same steps), a checkpoint every 3."""
    job = tiny_job(
        Path(root) / "cache",
        steps=MOE_STEPS,
        model={**model, "moe_balance": balance},
        optim={"schedule": "CONSTANT"},
        train=train,
        checkpoint={"every_steps": 3},
    )
    return write_job(Path(root) / f"{name}.yaml", job)


def assert_same_run(expected_dir, got_dir, steps: int = MOE_STEPS) -> None:
    """Two runs logged the same loss at every step and ended with the same weights, up to
    float summation order (one process accumulating vs several summing)."""
    import pytest

    expected, got = dict(train_losses(expected_dir)), dict(train_losses(got_dir))
    assert sorted(got) == sorted(expected) == list(range(1, steps + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    a, b = final_weights(expected_dir), final_weights(got_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
