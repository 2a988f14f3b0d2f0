"""`train`: the trainer's entry point, one per job, for every job kind.

    train --config configs/tiny.yaml [--run-dir DIR]
    train --spec JOBSPEC.json --run-dir DIR [--launcher HOST:PORT --job-id ID --attempt N]

Exit codes: 0 success, 1 failure, 2 bad config or input (the message names the field or
file), 75 preempted (SIGTERM or the launcher's stop: checkpoint saved, clean exit).
Run it under torchrun for several processes; only rank 0 writes logs and checkpoints.
"""

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_PREEMPTED = 0, 1, 2, 75


class BadInput(Exception):
    """A config or input problem: exit 2 with this message."""


def _user_path(path: str) -> Path:
    """Relative paths are the user's: `bazel run` changes directory, BUILD_WORKING_DIRECTORY
    says where the user was."""
    return Path(os.environ.get("BUILD_WORKING_DIRECTORY", "."), path).resolve()


def resolve_paths(cfg) -> None:
    """Make the config's relative paths absolute, from where the user ran the command."""
    fields = [(cfg.data, "input"), (cfg.data, "tokenizer_path"), (cfg.data, "cache_dir")]
    for msg, name in fields + [(cfg.checkpoint, "path")]:
        if getattr(msg, name):
            setattr(msg, name, str(_user_path(getattr(msg, name))))


def load_spec(args):
    from google.protobuf import json_format

    from protos import job_pb2

    if args.config:
        from protos.config_yaml import ConfigError, load_job_spec

        try:
            return load_job_spec(str(_user_path(args.config)))
        except (ConfigError, OSError) as e:
            raise BadInput(str(e)) from e
    path = _user_path(args.spec)
    try:
        return json_format.Parse(path.read_text(), job_pb2.JobSpec())
    except (json_format.ParseError, OSError) as e:
        raise BadInput(f"{path}: {e}") from e


def run_dir_for(args, spec) -> Path:
    if args.run_dir:
        return _user_path(args.run_dir)
    if spec.trainer.run_dir:
        return _user_path(spec.trainer.run_dir)
    return _user_path(os.path.join(".runs", spec.name or "job"))


def cache_dir_for(cfg, run_dir: Path) -> Path:
    """Where precooked datasets live: data.cache_dir, $KITCHEN_STATE_DIR/precook, or beside
    the run directory (so runs of one project share them)."""
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir)
    if os.environ.get("KITCHEN_STATE_DIR"):
        return Path(os.environ["KITCHEN_STATE_DIR"]) / "precook"
    return run_dir.parent / "precook"


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


def precook(cfg, run_dir: Path, env, log):
    """The precooked dataset of `cfg.data`, built by rank 0 while the others wait."""
    from trainer import distributed
    from trainer.data.precook import precook_dataset

    cache = cache_dir_for(cfg, run_dir)
    if env.is_main:
        log(f"precook: {cfg.data.input or 'the Python standard library'} -> cache {cache}")
        ds = precook_dataset(cfg.data, str(cache), show_progress=True)
    distributed.barrier()
    if not env.is_main:
        ds = precook_dataset(cfg.data, str(cache), show_progress=False)
    log(f"dataset {ds.path} ({'cache hit' if ds.cache_hit else 'built'})")
    return ds


def train(cfg, kind, run_dir, env, identity, log, client) -> int:
    from trainer import loop, plots

    ds = precook(cfg, run_dir, env, log)
    trainer = loop.Trainer(cfg, kind, run_dir, env, ds.path, ds.tokenizer.vocab_size, log=log)
    trainer.metrics.identity.update(identity)
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
        done = "preempted" if outcome == loop.PREEMPTED else "done"
        trainer.metrics.write(trainer._progress(phase=done, message=summary))
        png = plots.plot_loss(run_dir)
        if png:
            log(f"loss curves: {png}")
    return EXIT_PREEMPTED if outcome == loop.PREEMPTED else EXIT_OK


def load_checkpoint_model(cfg, run_dir: Path, env, log):
    """(model, meta, checkpoint dir) from checkpoint.path or the newest valid one of the run."""
    from trainer import checkpoint

    path = Path(cfg.checkpoint.path) if cfg.checkpoint.path else None
    if path is None:
        found = checkpoint.newest_valid(run_dir / "checkpoints", files=("model.pt",), warn=log)
        if found is None:
            raise BadInput(f"trainer.checkpoint.path: empty and no checkpoint in {run_dir}")
        path = found[0]
    try:
        model, meta = checkpoint.load_model(path, env.device, cfg.model.use_kernels)
    except checkpoint.CheckpointError as e:
        raise BadInput(f"trainer.checkpoint.path: {e}") from e
    log(f"loaded {path} (step {meta['step']})")
    return model, meta, path


def evaluate_job(cfg, run_dir, env, log) -> int:
    from trainer import evaluate
    from trainer.config import train_dtype
    from trainer.data.files import json_bytes, write_atomic

    model, meta, path = load_checkpoint_model(cfg, run_dir, env, log)
    dataset = meta["dataset"] if Path(meta["dataset"]).exists() else None
    dataset = dataset or precook(cfg, run_dir, env, log).path
    dtype = train_dtype(cfg, env.device)
    result = evaluate.heldout_loss(model, dataset, cfg, env, dtype)
    if result is None:
        raise BadInput(f"{dataset}: the eval split is empty (trainer.data.eval_fraction)")
    accuracy, asked = evaluate.choice_accuracy(model, dataset, cfg, env, dtype)
    log(
        f"eval {path.name}: loss {result.loss:.4f} nats/token, perplexity {result.perplexity:,.2f}"
        f" over {result.tokens:,} held-out tokens; continuation choice accuracy "
        f"{accuracy:.1%} on {asked} questions (chance {1 / evaluate.CHOICES:.0%})"
    )
    if env.is_main:
        report = dict(result._asdict(), checkpoint=str(path), step=meta["step"])
        report.update(choice_accuracy=accuracy, choice_questions=asked)
        write_atomic(str(run_dir / "eval.json"), json_bytes(report))
    return EXIT_OK


def generate_job(cfg, run_dir, env, log) -> int:
    from trainer.data.tokenizer import load_tokenizer
    from trainer.generate import generate

    model, meta, path = load_checkpoint_model(cfg, run_dir, env, log)
    dataset = meta["dataset"] if Path(meta["dataset"]).exists() else None
    tokenizer = load_tokenizer(dataset or precook(cfg, run_dir, env, log).path)
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
        max_len=int(meta["model"]["max_seq_len"]),
    )
    if env.is_main:
        print(g.prompt + tokenizer.decode(new), flush=True)
    log(f"generated {len(new)} tokens at {tokens_per_s:,.1f} tokens/s on {env.device.type}")
    return EXIT_OK


def parse_args(argv):
    p = argparse.ArgumentParser(prog="train", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="YAML job spec (configs/*.yaml)")
    source.add_argument("--spec", help="JobSpec as JSON (from the launcher)")
    p.add_argument("--run-dir", help="where metrics, checkpoints and plots go")
    p.add_argument("--launcher", help="HOST:PORT of the launcher to stream progress to")
    p.add_argument("--job-id", default="")
    p.add_argument("--attempt", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG


def _run(args) -> int:
    from protos import job_pb2
    from trainer import config, distributed
    from trainer.data.errors import PrecookError

    spec = load_spec(args)
    kind = job_pb2.JobKind.Name(spec.kind)
    if kind == "JOB_KIND_UNSPECIFIED":
        raise BadInput("kind: not set (one of PRECOOK, PRETRAIN, SFT, EVAL, GENERATE)")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = config.resolve(spec.trainer, kind, world_size)
    except config.ConfigError as e:
        raise BadInput(f"{args.config or args.spec}: {e}") from e
    resolve_paths(cfg)
    run_dir = run_dir_for(args, spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = distributed.init()
    log = make_log(run_dir, env.is_main)
    log(f"{kind} job {spec.name or '(unnamed)'} -> {run_dir}")
    client = None
    if args.launcher and env.is_main:
        from trainer.progress_client import ProgressClient

        client = ProgressClient(args.launcher, log=log)
    identity = {"job_id": args.job_id, "attempt": args.attempt}
    try:
        if client is not None:  # precooking can take a while: say the job is alive
            from protos import progress_pb2

            phase = {"EVAL": "eval", "GENERATE": "generate"}.get(kind, "precook")
            started = progress_pb2.Progress(phase=phase, message="started", **identity)
            client.send(started)
        if kind == "PRECOOK":
            counts = precook(cfg, run_dir, env, log).manifest["counts"]
            log(
                f"precooked {counts['documents']:,} documents, {counts['tokens']:,} tokens "
                f"in {counts['rows']:,} rows ({counts['padding_tokens']:,} padding tokens)"
            )
            return EXIT_OK
        if kind in ("PRETRAIN", "SFT"):
            return train(cfg, kind, run_dir, env, identity, log, client)
        if kind == "EVAL":
            return evaluate_job(cfg, run_dir, env, log)
        return generate_job(cfg, run_dir, env, log)
    except (PrecookError, config.ConfigError) as e:
        raise BadInput(str(e)) from e
    except Exception:
        log(f"FAILED:\n{traceback.format_exc()}")
        if not env.is_main:
            traceback.print_exc()
        return EXIT_FAILED
    finally:
        if client is not None:
            client.close()
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
