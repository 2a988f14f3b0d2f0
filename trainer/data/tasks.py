"""Distributed precook: one DataConfig as N tasks, byte-identical to precooking it on one machine.

    prepare   (one process) plan and hash the inputs, train the tokenizer once, write the job
              directory: job.json (the plan: units, files, sources) and tokenizer/
    task i    (N processes: run_local, or a PRECOOK job's tasks on the launcher's pool, a
              Slurm array job or local processes: task_steps.py) tokenize the i-th
              contiguous slice of the units, one .npz per unit, into a directory of its own
              (parts/<i>.tmp-*), renamed to parts/<i> when complete. A task whose part exists
              returns at once, so a rerun (or a retry of the one failed task) redoes nothing
              that finished.
    merge     (one process) read the parts in unit order as the single-machine tokenizer reads
              its workers' results, write the tokenized cache entry (tokenized._build), then
              pack: filters, dedup, the mixture and best-fit packing see every document's
              length, so they run here, over per-document arrays only (curate.py)

Equal to one machine by construction: the same tokenizer file, the same units in the same order
through the same tokenize_unit, the same writer. The job directory lives under the cache
(<cache>/jobs/<dataset key>) and is removed after the merge.
"""

import argparse
import base64
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import numpy as np

from protos import files
from protos.trainer_config_pb2 import DataConfig
from protos.validation import resolve_data
from trainer.data import cache as cache_mod
from trainer.data import manifest, tokenized, tokenizer
from trainer.data.corpus import CorpusPlan, InputFile, SourceReader, WorkUnit
from trainer.data.errors import PrecookError
from trainer.data.manifest import TokenizedManifest, TokenizerSection
from trainer.data.mixture import plan_sources
from trainer.data.precook import PrecookedDataset, dataset_key, precook_dataset
from trainer.data.progress import Progress, Say

JOB = "job.json"
TOKENIZER_DIR = "tokenizer"


class TaskError(PrecookError):
    pass


@dataclasses.dataclass(frozen=True)
class Job:
    directory: str
    n_tasks: int
    cfg: DataConfig  # resolved
    plan: CorpusPlan
    tokenizer: TokenizerSection | None  # None: the tokenized corpus is cached, nothing to do

    def part(self, index: int) -> str:
        return os.path.join(self.directory, "parts", f"{index:05d}")

    def units_of(self, index: int) -> range:
        """Task `index`'s contiguous slice of the units (sizes differ by at most one)."""
        n = len(self.plan.units) if self.tokenizer is not None else 0
        return range(n * index // self.n_tasks, n * (index + 1) // self.n_tasks)


def _b64(message) -> str:
    return base64.b64encode(message.SerializeToString()).decode("ascii")


def _plan_json(plan: CorpusPlan) -> dict:
    return {
        "description": plan.description,
        "root": plan.root,
        "fmt": plan.fmt,
        "records": plan.records,
        "skip_invalid_utf8": plan.skip_invalid_utf8,
        "files": [dataclasses.asdict(f) for f in plan.files],
        "units": [dataclasses.asdict(u) for u in plan.units],
        "sources": [{"name": r.name, "fmt": r.fmt, "cfg": _b64(r.cfg)} for r in plan.sources],
    }


def _plan_of(d: dict) -> CorpusPlan:
    readers = []
    for r in d["sources"]:
        cfg = DataConfig()
        cfg.ParseFromString(base64.b64decode(r["cfg"]))
        readers.append(SourceReader(r["name"], cfg, r["fmt"]))
    return CorpusPlan(
        d["description"],
        d["root"],
        d["fmt"],
        files=[InputFile(**f) for f in d["files"]],
        units=[WorkUnit(**{**u, "paths": tuple(u["paths"])}) for u in d["units"]],
        records=d["records"],
        skip_invalid_utf8=d["skip_invalid_utf8"],
        sources=readers,
    )


def prepare(cfg: DataConfig, cache_dir: str, n_tasks: int, say: Say) -> Job:
    """Plan the job and train its tokenizer once; a job directory already prepared for the
    same dataset (a rerun after a failure) is reused with the parts it holds."""
    cfg = resolve_data(cfg)
    plan = plan_sources(cfg)
    key = tokenized.tokenized_key(cfg, plan)
    # one job directory per dataset key: a rerun of the same config finds its parts
    directory = os.path.join(os.path.abspath(cache_dir), "jobs", dataset_key(cfg, key)[:16])
    if os.path.exists(os.path.join(directory, JOB)):
        job = load(directory)
        if job.n_tasks == n_tasks:
            say(f"resuming {directory}: parts done {done(job)}")
            return job
        shutil.rmtree(directory)  # another task count: other slices
    os.makedirs(os.path.join(directory, "parts"), exist_ok=True)
    cache = cache_mod.Cache(cache_dir)
    section = None
    if cache.lookup(TokenizedManifest, tokenized.entry_name(cfg, key), key) is None:
        tok = tokenized.make_tokenizer(cfg, plan, say)
        os.makedirs(os.path.join(directory, TOKENIZER_DIR), exist_ok=True)
        section = tok.save(os.path.join(directory, TOKENIZER_DIR))
    body = {
        "n_tasks": n_tasks,
        "config": _b64(cfg),
        "plan": _plan_json(plan),
        "tokenizer": None if section is None else manifest.to_json(section),
    }
    files.write_json_atomic(os.path.join(directory, JOB), body)
    return load(directory)


def load(directory: str) -> Job:
    with open(os.path.join(directory, JOB), encoding="utf-8") as f:
        body = json.load(f)
    cfg = DataConfig()
    cfg.ParseFromString(base64.b64decode(body["config"]))
    section = body["tokenizer"]
    if section is not None:
        section = manifest.from_json(TokenizerSection, section, "tokenizer")
    return Job(directory, body["n_tasks"], cfg, _plan_of(body["plan"]), section)


def done(job: Job) -> list[int]:
    return [i for i in range(job.n_tasks) if os.path.isdir(job.part(i))]


def run_task(directory: str, index: int) -> bool:
    """Tokenize task `index`'s units into its part; False when the part was there already."""
    job = load(directory)
    if not 0 <= index < job.n_tasks:
        raise TaskError(f"{directory}: task {index} is not in 0..{job.n_tasks - 1}")
    part = job.part(index)
    if os.path.isdir(part):
        return False
    # A directory of this run's own: the same task can run twice at once (a Slurm step
    # orphaned by a launcher crash next to its retry, a requeue), and two runs sharing one
    # directory could rename a part with units missing. A killed run's directory stays until
    # the merge removes the job directory.
    os.makedirs(os.path.dirname(part), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{os.path.basename(part)}.tmp-", dir=os.path.dirname(part))
    units = job.units_of(index)
    if len(units) and job.tokenizer is not None:
        tok_dir = os.path.join(directory, TOKENIZER_DIR)
        tokenized._load_worker(*tokenized.worker_args(job.cfg, job.plan, job.tokenizer, tok_dir))
        # precook's progress line, on stderr: the launcher's hang detector reads a step's log
        # line as a sign of life (launcher/executors/task_array.py last_output).
        records = sum(job.plan.units[u].n_records for u in units)
        bar = Progress(f"task {index}: tokenize", records)
        for u in units:
            result = tokenized.tokenize_unit(job.plan.units[u])
            _save_result(os.path.join(tmp, f"unit-{u:07d}.npz"), result)
            read, _, tokens, _, skipped, n_empty, _ = result
            bar.update(len(read) + len(skipped) + n_empty, len(tokens))
        bar.close()
    files.fsync_dir(tmp)
    try:
        os.rename(tmp, part)
    except OSError:
        if not os.path.isdir(part):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another run finished first: the same bytes
        return False
    files.fsync_dir(os.path.dirname(part))
    return True


def _save_result(path: str, result) -> None:
    index, lengths, tokens, mask, skipped, n_empty, feats = result
    arrays = dict(index=index, lengths=lengths, tokens=tokens, n_empty=np.array(n_empty))
    arrays["skipped"] = np.array(skipped, dtype=str)
    if mask is not None:
        arrays["mask"] = mask
    for f in dataclasses.fields(feats):
        if getattr(feats, f.name) is not None:
            arrays[f"feature_{f.name}"] = getattr(feats, f.name)
    with open(f"{path}.tmp", "wb") as out:
        np.savez(out, **arrays)
    os.replace(f"{path}.tmp", path)


def _read_results(job: Job) -> Iterator:
    """tokenize_unit's results for every unit, in corpus order, from the parts."""
    for index in range(job.n_tasks):
        for u in job.units_of(index):
            with np.load(os.path.join(job.part(index), f"unit-{u:07d}.npz")) as z:
                feats = tokenized.DocFeatures(
                    **{
                        f.name: z[f"feature_{f.name}"] if f"feature_{f.name}" in z else None
                        for f in dataclasses.fields(tokenized.DocFeatures)
                    }
                )
                mask = z["mask"] if "mask" in z else None
                skipped = z["skipped"].tolist()
                yield z["index"], z["lengths"], z["tokens"], mask, skipped, int(z["n_empty"]), feats


def merge(job: Job, cache_dir: str, say: Say, show_progress: bool = False) -> PrecookedDataset:
    """Write the tokenized corpus from the parts and pack it; TaskError if a part is missing."""
    missing = sorted(set(range(job.n_tasks)) - set(done(job)))
    if missing:
        raise TaskError(f"{job.directory}: tasks {missing} have not finished: cannot merge")
    if job.tokenizer is not None:
        cfg, plan = job.cfg, job.plan
        key = tokenized.tokenized_key(cfg, plan)
        tok = tokenizer.from_section(job.tokenizer, os.path.join(job.directory, TOKENIZER_DIR))
        build = lambda tmp: tokenized._build(
            tmp, cfg, plan, key, False, say, tok=tok, results=_read_results(job)
        )
        cache = cache_mod.Cache(cache_dir)
        cache.get_or_build(TokenizedManifest, tokenized.entry_name(cfg, key), key, build, say)
    ds = precook_dataset(job.cfg, cache_dir, show_progress=show_progress)
    shutil.rmtree(job.directory, ignore_errors=True)
    return ds


def task_argv(directory: str, index: str) -> list[str]:
    """The command of one task (`index` may be a shell variable such as $SLURM_ARRAY_TASK_ID)."""
    return [sys.executable, "-m", "trainer.data.tasks", "--job", directory, "--index", index]


def run_local(
    job: Job, retries: int = 1, on_start: Callable[[int, subprocess.Popen], None] | None = None
) -> dict[int, int]:
    """Run the unfinished tasks as processes (at most 4 at once), then retry each failed one
    alone, up to `retries` times. Returns attempts per task; TaskError if one still fails."""
    attempts = {i: 0 for i in range(job.n_tasks)}
    todo = [i for i in range(job.n_tasks) if i not in done(job)]
    for _ in range(retries + 1):
        failed = []
        for lo in range(0, len(todo), 4):
            procs = {}
            for i in todo[lo : lo + 4]:
                procs[i] = subprocess.Popen(task_argv(job.directory, str(i)))
                attempts[i] += 1
                if on_start is not None:
                    on_start(i, procs[i])
            failed += [i for i, p in procs.items() if p.wait() != 0]
        if not failed:
            return attempts
        todo = failed
    raise TaskError(f"{job.directory}: tasks {failed} failed {retries + 1} times")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="precook-task", description="run one precook task")
    p.add_argument("--job", required=True, help="the job directory (tasks.prepare)")
    p.add_argument("--index", type=int, required=True, help="which task, 0..N-1")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        ran = run_task(args.job, args.index)
    except PrecookError as err:
        print(f"precook task {args.index}: error: {err}", file=sys.stderr)
        return 2
    print(f"precook task {args.index}: {'done' if ran else 'already done'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
