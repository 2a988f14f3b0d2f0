"""precook: build a packed dataset, or analyze what each packing strategy wastes.

    bazel run //trainer:precook -- build [--input PATH] [--seq-len 256] [--packing best_fit] ...
    bazel run //trainer:precook -- analyze [--input PATH] [--seq-len 2048,4096,8192] [--json]

Without --input the corpus is the running interpreter's standard library (*.py files).
Every flag sets the kitchen.v1.DataConfig field of the same name (protos/trainer_config.proto).
Exit status: 0 done, 2 bad input (the message names the flag or the file and line).
"""

import argparse
import json
import sys

from protos.config_yaml import ConfigError
from protos.enums import enum_value
from protos.paths import PATH_FIELDS, precook_cache_dir, user_path
from protos.validation import resolve_data
from trainer.data import analyze as analyze_mod
from trainer.data.errors import PrecookError
from trainer.data.manifest import as_json
from trainer.data.mixture import SINGLE
from trainer.data.packing import STRATEGIES
from trainer.data.precook import PrecookedDataset, precook_dataset
from trainer.data.progress import reporter
from trainer.data.shards import SPLITS
from trainer.data.task_steps import precook_as_tasks

FORMATS = ("text_files", "jsonl", "jsonl_chat")
TOKENIZERS = ("bpe_train", "bpe_file", "cl100k")


def _add_corpus_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", default="", help="directory, file or glob (default: the stdlib)")
    p.add_argument("--format", choices=FORMATS, help="default text_files")
    p.add_argument("--text-field", help='JSONL: field holding the text (default "text")')
    p.add_argument("--prompt-field", help='JSONL_CHAT: prompt field (default "prompt")')
    p.add_argument("--response-field", help='JSONL_CHAT: response field (default "response")')
    p.add_argument("--tokenizer", choices=TOKENIZERS, help="default bpe_train")
    p.add_argument("--vocab-size", type=int, help="bpe_train: vocabulary size (default 4096)")
    p.add_argument("--tokenizer-path", default="", help="bpe_file: a tokenizer.json")
    p.add_argument("--workers", type=int, help="tokenizing processes (default: CPUs)")
    p.add_argument("--cache-dir", default="", help="default <state dir>/precook (protos/paths)")
    p.add_argument("--eval-fraction", type=float, help="documents held out (default 0.02)")
    p.add_argument("--max-documents", type=int, help="use the first N documents (0 = all)")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=INPUT[,format=F][,text_field=X][,weight=W|,token_budget=N]",
        help="a mixture source (repeat the flag; replaces --input)",
    )
    p.add_argument("--mixture-seed", type=int, help="default 1234")
    p.add_argument("--dedup-exact", action="store_true", help="drop exact duplicates")
    p.add_argument("--near-dup-threshold", type=float, help="MinHash-LSH Jaccard (0 = off)")
    p.add_argument("--min-doc-tokens", type=int, help="drop shorter documents")
    p.add_argument("--max-doc-tokens", type=int, help="drop longer documents (0 = no limit)")
    p.add_argument("--min-alpha-fraction", type=float, help="drop documents with fewer letters")
    p.add_argument("--max-repeated-line-fraction", type=float, help="drop repetitive documents")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="precook", description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="precook a dataset (cached)")
    _add_corpus_flags(build)
    build.add_argument("--seq-len", type=int, help="tokens per row (default 256)")
    build.add_argument("--packing", choices=STRATEGIES, help="default best_fit")
    build.add_argument("--shard-tokens", type=int, help="tokens per shard (default 16Mi)")
    build.add_argument(
        "--tasks", type=int, help="as N local processes (default 1; on Slurm: a PRECOOK job)"
    )
    analyze = sub.add_parser("analyze", help="padding waste and efficiency of every strategy")
    _add_corpus_flags(analyze)
    analyze.add_argument("--seq-len", default="2048,4096,8192", help="comma-separated lengths")
    analyze.add_argument("--plot", default="precook_lengths.png", help="histogram PNG path")
    analyze.add_argument("--no-plot", action="store_true", help="skip the histogram")
    return top


def data_config(args):
    """The DataConfig the flags describe (unset flags stay unset: defaults apply later)."""
    from protos import trainer_config_pb2

    cfg = trainer_config_pb2.DataConfig(input=args.input, tokenizer_path=args.tokenizer_path)
    cfg.cache_dir = args.cache_dir
    for field in ("text_field", "prompt_field", "response_field", "vocab_size", "workers"):
        if getattr(args, field) is not None:
            setattr(cfg, field, getattr(args, field))
    for field in (*CURATION_FLAGS, "eval_fraction", "max_documents", "shard_tokens", "tasks"):
        if getattr(args, field, None) is not None:  # shard_tokens, tasks: `build` only
            setattr(cfg, field, getattr(args, field))
    if args.dedup_exact:
        cfg.dedup_exact = True
    for i, spec in enumerate(args.source):
        _add_source(cfg, spec, f"data.sources[{i}]")
    for field in ("format", "tokenizer", "packing"):
        if getattr(args, field, None):
            setattr(cfg, field, enum_value(cfg, field, getattr(args, field), f"data.{field}"))
    if args.command == "build" and args.seq_len is not None:
        cfg.seq_len = args.seq_len
    for section, field in PATH_FIELDS:
        if section == "data":
            setattr(cfg, field, user_path(getattr(cfg, field)))
    return cfg


CURATION_FLAGS = (
    "mixture_seed",
    "near_dup_threshold",
    "min_doc_tokens",
    "max_doc_tokens",
    "min_alpha_fraction",
    "max_repeated_line_fraction",
)
SOURCE_KEYS = {"format": str, "text_field": str, "weight": float, "token_budget": int}


def _add_source(cfg, spec: str, path: str) -> None:
    """`--source name=input,key=value,...` as a DataSource."""
    head, *options = spec.split(",")
    name, eq, source_input = head.partition("=")
    if not eq or not name or not source_input:
        raise ConfigError(f"{path}.name", f"{spec!r}: expected NAME=INPUT[,key=value...]")
    src = cfg.sources.add(name=name, input=user_path(source_input))
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or key not in SOURCE_KEYS:
            raise ConfigError(f"{path}.{key}", f"{option!r}: keys are {', '.join(SOURCE_KEYS)}")
        if key == "format":
            src.format = enum_value(src, "format", value, f"{path}.format")
            continue
        try:
            setattr(src, key, SOURCE_KEYS[key](value))
        except ValueError:
            raise ConfigError(f"{path}.{key}", f"{value!r} is not a number") from None


def _seq_lens(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError("data.seq_len", f"{text!r} is not a comma-separated list") from None
    if not values or min(values) < 2:
        raise ConfigError("data.seq_len", f"{text!r}: every length must be at least 2 tokens")
    return sorted(set(values))


def _summary(ds: PrecookedDataset) -> str:
    m = ds.manifest
    lines = [f"{'cache hit' if ds.cache_hit else 'precooked'}: {ds.path}"]
    width = "<= " if m.packing == "bucket" else ""
    for name in SPLITS:
        s = m.splits[name]
        fill = 100 * s.target_tokens / max(s.slots, 1)
        lines.append(
            f"  {name:<5} {s.documents:>8,} documents  {s.tokens:>12,} tokens  "
            f"{s.rows:>8,} rows of {width}{m.seq_len} ({m.packing})  {fill:6.2f}% of "
            f"slots trained on  {s.truncated_tokens:,} tokens truncated"
        )
    if m.curation is not None and m.curation.kept < m.curation.documents:
        c, f, d = m.curation, m.curation.filtered, m.curation.deduplicated
        lines.append(
            f"  curation: {c.documents:,} documents, {c.kept:,} kept; dropped {f.too_short:,} "
            f"short, {f.too_long:,} long, {f.low_alpha:,} low-alpha, {f.repeated_lines:,} "
            f"repetitive, {d.exact_duplicates:,} exact and {d.near_duplicates:,} near duplicates"
        )
    mixture = m.sources is not None and list(m.sources) != [SINGLE]
    for name, src in (m.sources or {}).items() if mixture else ():
        lines.append(
            f"  source {name}: {src.selected_tokens:,} of {src.tokens:,} train tokens "
            f"({src.epochs:g} epochs)"
        )
    t = m.tokenizer
    lines.append(f"  tokenizer: {t.kind}, {t.vocab_size:,} ids, shards {m.token_dtype}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    say = reporter(not args.json)
    try:
        cfg = data_config(args)
        cache_dir = precook_cache_dir(cfg)
        if args.command == "build":
            if resolve_data(cfg).tasks > 1:
                ds = precook_as_tasks(cfg, cache_dir, quiet=args.json)
            else:
                ds = precook_dataset(cfg, cache_dir, show_progress=not args.json)
            if args.json:
                manifest_json = as_json(ds.manifest)
                out = {"path": ds.path, "cache_hit": ds.cache_hit, "manifest": manifest_json}
                print(json.dumps(out, indent=1))
            else:
                print(_summary(ds))
            return 0
        seq_lens = _seq_lens(args.seq_len)
        resolved = resolve_data(cfg)
        plot = None if args.no_plot else user_path(args.plot)
        report = analyze_mod.analyze(resolved, cache_dir, seq_lens, plot, not args.json, say)
        print(json.dumps(report, indent=1) if args.json else analyze_mod.format_table(report))
        return 0
    except ConfigError as err:  # every field is a flag: name both
        flag = "--" + err.field.removeprefix("data.").replace("_", "-")
        if err.field.startswith("data.sources"):
            flag = "--source"
        print(f"precook: error: {flag} ({err.field}): {err.problem}", file=sys.stderr)
        return 2
    except PrecookError as err:
        print(f"precook: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
