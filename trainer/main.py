"""`train`: the trainer's entry point, one per job, for every job kind.

    train --config configs/tiny.yaml [--run-dir DIR]   a job run by hand
    train --attempt ATTEMPT.json                       an attempt the launcher started

The launcher hands an attempt everything it did not configure itself (run directory, precook
cache, job id, attempt number, where to report, the token file) in one kitchen.v1.Attempt
(protos/attempt.proto). A job run by hand gets the same message built here: the run
directory is --run-dir or <state dir>/runs/<name>, the cache data.cache_dir or <state
dir>/precook (protos/paths.py), so it shares its precooked data with //trainer:precook.

Exit codes (protos/exit_codes.py): 0 success, 1 failure, 2 bad config or input (the message
names the field or file), 75 preempted (SIGTERM or the launcher's stop: checkpoint saved).
Run it under torchrun for several processes; only rank 0 writes logs and checkpoints.
"""

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from google.protobuf import json_format

from protos import attempt_pb2, job_pb2, paths
from protos.config_yaml import ConfigError, load_job_spec
from protos.exit_codes import ExitCode
from protos.precook_steps import PrecookStep
from protos.validation import validate_job_spec


class BadInput(Exception):
    """A config or input problem: exit 2 with this message."""


def attempt_from_config(config: str, run_dir: str = "") -> attempt_pb2.Attempt:
    """The Attempt of a job run by hand from a YAML config (paths are the user's)."""
    try:
        spec = load_job_spec(paths.user_path(config))
    except ConfigError as e:
        raise BadInput(str(e)) from e
    paths.absolute_paths(spec.trainer)
    state = paths.state_dir()
    run_dir = paths.user_path(run_dir) or paths.run_dir_for(state, spec.name or "job")
    cache_dir = paths.precook_cache_dir(spec.trainer.data, state)
    return attempt_pb2.Attempt(spec=spec, run_dir=run_dir, cache_dir=cache_dir)


def read_attempt(path: str) -> attempt_pb2.Attempt:
    """The launcher's handoff (json_format of kitchen.v1.Attempt)."""
    try:
        attempt = json_format.Parse(Path(path).read_text(), attempt_pb2.Attempt())
    except (json_format.ParseError, OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not a kitchen.v1.Attempt: {e}") from e
    for field in ("run_dir", "cache_dir"):
        if not os.path.isabs(getattr(attempt, field)):
            raise BadInput(f"{path}: {field} must be an absolute path")
    return attempt


def make_log(run_dir: Path, is_main: bool):
    """print() to stdout and train.log on rank 0; other ranks stay quiet."""
    log_file = open(run_dir / "train.log", "a") if is_main else None  # noqa: SIM115

    def log(message: str) -> None:
        if log_file is None:
            return
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    return log


def precook(cfg, cache: str, env, log):
    """The precooked dataset of `cfg.data` in `cache`, built by rank 0 while the others wait."""
    from trainer import distributed
    from trainer.data.precook import precook_dataset

    if env.is_main:
        try:
            os.makedirs(cache, exist_ok=True)
        except OSError as e:
            raise BadInput(
                f"trainer.data.cache_dir: cannot create the precook cache {cache}: {e.strerror} "
                f"(set data.cache_dir, or {paths.STATE_DIR_ENV} for the state dir)"
            ) from e
        log(f"precook: {cfg.data.input or 'the Python standard library'} -> cache {cache}")
        ds = precook_dataset(cfg.data, cache, show_progress=True)
    distributed.barrier()
    if not env.is_main:
        ds = precook_dataset(cfg.data, cache, show_progress=False)
    log(f"dataset {ds.path} ({'cache hit' if ds.cache_hit else 'built'})")
    return ds


def train(cfg, attempt: attempt_pb2.Attempt, env, log, client) -> ExitCode:
    from trainer import loop, plots

    run_dir = Path(attempt.run_dir)
    ds = precook(cfg, attempt.cache_dir, env, log)
    kind = attempt.spec.kind
    trainer = loop.Trainer(cfg, kind, run_dir, env, ds.path, ds.tokenizer.vocab_size, log=log)
    trainer.metrics.identity.update(job_id=attempt.job_id, attempt=attempt.number)
    if client is not None:
        trainer.metrics.sinks.append(client.send)
    sigterm = loop.install_sigterm_handler()
    launcher_stop = client.stop_requested.is_set if client else (lambda: False)
    trainer.stop_requested = lambda: sigterm() or launcher_stop()
    trainer.resume_or_init()
    outcome = trainer.run()
    summary = trainer.goodput.summary()
    log(summary)
    if env.is_main:
        trainer.metrics.write(trainer._progress(phase=outcome.value, message=summary))
        png = plots.plot_loss(run_dir)
        if png:
            log(f"loss curves: {png}")
    return ExitCode.PREEMPTED if outcome is loop.Outcome.PREEMPTED else ExitCode.OK


def load_checkpoint_model(cfg, run_dir: Path, env, log, path: Path | None = None):
    """(model, meta, checkpoint dir) from `path`, checkpoint.path or the newest valid one of
    the run."""
    from trainer import checkpoint

    if path is None and cfg.checkpoint.path:
        path = Path(cfg.checkpoint.path)
    if path is None:
        found = checkpoint.newest_valid(run_dir / "checkpoints", files=("model.pt",), warn=log)
        if found is None:
            raise BadInput(f"trainer.checkpoint.path: empty and no checkpoint in {run_dir}")
        path = found[0]
    try:
        model, meta = checkpoint.load_model(path, env.device, cfg.model.use_kernels)
    except checkpoint.CheckpointError as e:
        raise BadInput(f"trainer.checkpoint.path: {e}") from e
    log(f"loaded {path} (step {meta.step})")
    return model, meta, path


def _dataset_of(meta, cfg, attempt: attempt_pb2.Attempt, env, log) -> str:
    """The checkpoint's own dataset when it is still there, else `cfg.data` precooked (an
    imported checkpoint has none: its job names the data, with the model's tokenizer)."""
    if meta.dataset and Path(meta.dataset).exists():
        return meta.dataset
    ds = precook(cfg, attempt.cache_dir, env, log)
    if ds.tokenizer.vocab_size != meta.vocab_size:
        raise BadInput(
            f"trainer.data.tokenizer: {ds.tokenizer.vocab_size} tokens, the checkpoint's model "
            f"{meta.vocab_size}: precook with its tokenizer (BPE_FILE, tokenizer_path)"
        )
    return ds.path


def evaluate_job(cfg, attempt: attempt_pb2.Attempt, env, log, client) -> ExitCode:
    """Held-out loss, continuation choice and the harness tasks of trainer.eval.tasks: of one
    checkpoint (eval.json), or of every checkpoint under trainer.eval.sweep (sweep.json and
    sweep.png). Each checkpoint's scores are a Progress record (trainer/interop/)."""
    from protos.files import write_json_atomic
    from protos.progress_log import append_progress, log_path
    from trainer import checkpoint
    from trainer.config import train_dtype
    from trainer.interop import checkpoint_eval, harness, sweep

    run_dir = Path(attempt.run_dir)
    dtype = train_dtype(cfg, env.device)
    if cfg.eval.tasks:  # an unknown task name: exit 2 before any checkpoint is evaluated
        harness.task_specs(list(cfg.eval.tasks), cfg.eval.tasks_dir, cfg.eval.allow_task_code)
    targets: list[tuple[str, Path | None]] = [("", None)]
    if cfg.eval.sweep:
        targets = list(sweep.sweep_targets(Path(cfg.eval.sweep)))
    rows: list[dict] = []
    report: dict = {}
    for run, target in targets:
        if target is not None:
            try:
                checkpoint.verify(target, files=("model.pt",))
            except checkpoint.CheckpointError as e:
                log(f"WARNING: skipping damaged checkpoint: {e}")
                continue
        model, meta, path = load_checkpoint_model(cfg, run_dir, env, log, target)
        dataset = _dataset_of(meta, cfg, attempt, env, log)
        report, scores = checkpoint_eval.evaluate_checkpoint(
            model, meta, path, dataset, cfg, env, dtype, log
        )
        if env.is_main:
            ids = {"job_id": attempt.job_id, "attempt": attempt.number}
            record = checkpoint_eval.progress(meta.step, path, scores, **ids)
            append_progress(log_path(run_dir), record)
            if client is not None:
                client.send(record)
        rows.append(sweep.row(run or run_dir.name, path, meta.step, scores))
    if env.is_main and cfg.eval.sweep:
        log(f"sweep of {len(rows)} checkpoints: {sweep.write_sweep(run_dir, rows)}")
    elif env.is_main:
        write_json_atomic(str(run_dir / "eval.json"), report)
    return ExitCode.OK


def generate_job(cfg, attempt: attempt_pb2.Attempt, env, log) -> ExitCode:
    from trainer.data.tokenizer import load_tokenizer
    from trainer.generate import generate

    model, meta, path = load_checkpoint_model(cfg, Path(attempt.run_dir), env, log)
    tokenizer = load_tokenizer(_dataset_of(meta, cfg, attempt, env, log))
    g = cfg.generate
    prompt = [tokenizer.bos_id] + tokenizer.encode(g.prompt)  # documents start with BOS
    new, tokens_per_s = generate(
        model,
        prompt,
        g.max_new_tokens,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        seed=g.seed,
        stop_id=tokenizer.eos_id,
        max_len=meta.model.max_seq_len,
    )
    if env.is_main:
        print(g.prompt + tokenizer.decode(new), flush=True)
    log(f"generated {len(new)} tokens at {tokens_per_s:,.1f} tokens/s on {env.device.type}")
    return ExitCode.OK


def export_job(cfg, attempt: attempt_pb2.Attempt, env, log) -> ExitCode:
    """A checkpoint as a Hugging Face model directory: trainer.hf.path, else <run dir>/hf."""
    from trainer.data.tokenizer import load_tokenizer
    from trainer.interop.hf_export import export_checkpoint

    run_dir = Path(attempt.run_dir)
    _, meta, path = load_checkpoint_model(cfg, run_dir, env, log)
    tokenizer = load_tokenizer(_dataset_of(meta, cfg, attempt, env, log))
    if env.is_main:
        try:
            done = export_checkpoint(path, tokenizer, Path(cfg.hf.path or run_dir / "hf"))
        except FileExistsError as e:
            raise BadInput(f"trainer.hf.path: {e}") from e
        size = sum(d.bytes for d in done.files.values())
        log(
            f"exported {path.name} ({done.parameters:,} parameters) -> {done.path} ({size:,} bytes)"
        )
    return ExitCode.OK


def import_job(cfg, attempt: attempt_pb2.Attempt, env, log) -> ExitCode:
    """A Hugging Face Llama directory (trainer.hf.path) as checkpoint step 0 of this run."""
    from trainer.interop.hf_import import import_hf

    if not env.is_main:
        return ExitCode.OK
    path, meta = import_hf(Path(cfg.hf.path), Path(attempt.run_dir) / "checkpoints")
    model = json_format.MessageToDict(meta.model, preserving_proto_field_name=True)
    log(f"imported {cfg.hf.path} -> {path} (vocabulary {meta.vocab_size:,})")
    log(f"to fine-tune it: checkpoint.path {path}, trainer.model {model}")
    return ExitCode.OK


def serve_job(cfg, attempt: attempt_pb2.Attempt, env, log, client) -> ExitCode:
    """The checkpoint served over an OpenAI-compatible API until stopped (trainer/serve/)."""
    from trainer.data.tokenizer import load_tokenizer
    from trainer.serve.server import serve

    model, meta, path = load_checkpoint_model(cfg, Path(attempt.run_dir), env, log)
    tokenizer = load_tokenizer(_dataset_of(meta, cfg, attempt, env, log))
    return serve(model, tokenizer, meta.model.max_seq_len, cfg.serve, attempt, log, client)


def run_job(cfg, attempt: attempt_pb2.Attempt, env, log, client) -> ExitCode:
    """The job of `attempt.spec.kind`."""
    kind = attempt.spec.kind
    from trainer.vlm import job as vlm  # #16: a VLM stage, or precook/eval/generate on images

    if vlm.handles(kind, cfg):
        return vlm.run(cfg, attempt, env, log, client)
    if kind == job_pb2.PRECOOK and cfg.data.tasks > 1:  # #21: as N local processes, by hand
        from trainer.data import task_steps

        log(task_steps.summary(task_steps.precook_as_tasks(cfg.data, attempt.cache_dir)))
        return ExitCode.OK
    if kind == job_pb2.PRECOOK:
        counts = precook(cfg, attempt.cache_dir, env, log).manifest.counts
        log(
            f"precooked {counts.documents:,} documents, {counts.tokens:,} tokens "
            f"in {counts.rows:,} rows ({counts.padding_tokens:,} padding tokens)"
        )
        return ExitCode.OK
    if kind in (job_pb2.PRETRAIN, job_pb2.SFT):
        return train(cfg, attempt, env, log, client)
    if kind == job_pb2.EXPORT:
        return export_job(cfg, attempt, env, log)
    if kind == job_pb2.IMPORT:
        return import_job(cfg, attempt, env, log)
    if kind == job_pb2.EVAL:
        return evaluate_job(cfg, attempt, env, log, client)
    if kind in (job_pb2.REWARD, job_pb2.DPO, job_pb2.PPO):  # #14: trainer/rl/
        from trainer.rl import dpo, ppo, reward_model

        rl_job = {job_pb2.REWARD: reward_model.run, job_pb2.DPO: dpo.run, job_pb2.PPO: ppo.run}
        return rl_job[kind](cfg, attempt, env, log, client)
    if kind == job_pb2.SERVE:
        return serve_job(cfg, attempt, env, log, client)
    return generate_job(cfg, attempt, env, log)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="train", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="YAML job spec (configs/*.yaml): a job run by hand")
    source.add_argument("--attempt", help="kitchen.v1.Attempt as JSON (from the launcher)")
    p.add_argument("--run-dir", help="with --config: where metrics, checkpoints and plots go")
    steps = [s.value for s in PrecookStep]  # #21: a PRECOOK job's tasks, run by the launcher
    p.add_argument("--precook-step", choices=steps, help="with --attempt: one step of its tasks")
    p.add_argument("--task-index", type=int, help="--precook-step task: which task, 0..N-1")
    args = p.parse_args(argv)
    if args.precook_step and not args.attempt:
        p.error("--precook-step runs a step of a launched attempt: give --attempt")
    if args.attempt and args.run_dir:
        p.error("--run-dir is the attempt's run_dir: give it with --config only")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.precook_step:  # one step of a PRECOOK job's tasks: no torch, no process group
            from trainer.data import task_steps

            attempt = read_attempt(paths.user_path(args.attempt))
            step = PrecookStep(args.precook_step)
            return int(task_steps.run(attempt, step, args.task_index))
        return int(_run(args))
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return ExitCode.BAD_CONFIG


def _run(args) -> ExitCode:
    from trainer import distributed
    from trainer.data.errors import PrecookError

    if args.attempt:
        attempt = read_attempt(paths.user_path(args.attempt))
    else:
        attempt = attempt_from_config(args.config, args.run_dir or "")
    spec = attempt.spec
    try:  # the launcher ran the same check at submit; a job by hand meets it here
        cfg = validate_job_spec(spec, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        raise BadInput(f"{args.config or args.attempt}: {e}") from e
    kind = job_pb2.JobKind.Name(spec.kind)
    run_dir = Path(attempt.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = distributed.init()
    log = make_log(run_dir, env.is_main)
    log(f"{kind} job {spec.name or '(unnamed)'} -> {run_dir}")
    client = None
    if attempt.launcher and env.is_main:
        from trainer.progress_client import ProgressClient

        client = ProgressClient(attempt, log=log)
    try:
        if client is not None:  # precooking can take a while: say the job is alive
            from protos import progress_pb2

            phase = {"EVAL": "eval", "GENERATE": "generate"}.get(kind, "precook")
            phase = {"EXPORT": "export", "IMPORT": "import"}.get(kind, phase)
            started = progress_pb2.Progress(
                phase=phase, message="started", job_id=attempt.job_id, attempt=attempt.number
            )
            client.send(started)
        code = run_job(cfg, attempt, env, log, client)
        # Every rank leaves together: a rank that tore the process group down while rank 0
        # still wrote its plot aborted now and then ("terminate called without an active
        # exception", exit -6). Only on success: after a failure a peer may be gone.
        distributed.barrier()
        return code
    except (PrecookError, ConfigError) as e:
        raise BadInput(str(e)) from e
    except BadInput:  # a checkpoint that does not load, ...: exit 2, not a failure to retry
        raise
    except Exception:
        log(f"FAILED:\n{traceback.format_exc()}")
        if not env.is_main:
            traceback.print_exc()
        return ExitCode.FAILED
    finally:
        if client is not None:
            client.close()
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
