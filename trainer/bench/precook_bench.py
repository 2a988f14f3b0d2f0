"""Precook benchmark: throughput against the tokenizer alone, best_fit at scale, packing.

    PYTHONPATH=.:.gen python3 trainer/bench/precook_bench.py --out trainer/bench/precook_results.md

1. End-to-end `precook_dataset` tokens/s (hash inputs, read, tokenize in worker processes,
   pack best_fit at 4096, write shards and manifest) against the tokenizer's own batch encode
   (HF `encode_batch` / `encode_batch_fast`, all cores, texts already in memory) on the same
   text, alternating in one run. Goal: >= 0.8.
2. best_fit time for 1,000,000 documents whose lengths are drawn (with replacement, seeded)
   from the standard library's real document lengths in tokens.
3. Packing efficiency of every strategy at 4096 and 8192 on the standard library.
"""

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import numpy as np

from trainer.bench.machine import machine
from trainer.data import analyze, packing, tokenizer
from trainer.data.corpus import plan_corpus, read_unit
from trainer.data.precook import precook_dataset


def stdlib_texts() -> list[str]:
    from protos import trainer_config_pb2

    cfg = trainer_config_pb2.DataConfig()
    plan = plan_corpus(cfg, "TEXT_FILES")
    return [
        r.text
        for unit in plan.units
        for r in read_unit(unit, cfg, "TEXT_FILES", skip_invalid_utf8=True)
        if r.text is not None and r.text.strip()
    ]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def baseline(tokenizer_json: str, texts: list[str]) -> tuple[float, int, str, float]:
    """The tokenizer's own batch encode, the faster of its two batch APIs:
    (tokens/s, tokens, api, CPU seconds)."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(tokenizer_json)
    best = (0.0, 0, "", 0.0)
    for api in ("encode_batch", "encode_batch_fast"):
        start, cpu = time.perf_counter(), time.process_time()
        n = sum(len(e.ids) for e in getattr(hf, api)(texts, add_special_tokens=False))
        rate = n / (time.perf_counter() - start)
        best = max(best, (rate, n, api, time.process_time() - cpu))
    return best


def precook_run(tokenizer_json: str) -> tuple[float, int, float, float]:
    """(tokens/s, text tokens, seconds, CPU seconds of this process and its workers)."""
    from protos import trainer_config_pb2 as pb

    cfg = pb.DataConfig(tokenizer=pb.BPE_FILE, tokenizer_path=tokenizer_json, seq_len=4096)
    cfg.packing = pb.BEST_FIT
    with tempfile.TemporaryDirectory() as cache:
        start, cpu, child_cpu = time.perf_counter(), time.process_time(), children_cpu_s()
        ds = precook_dataset(cfg, cache, show_progress=False)
        seconds = time.perf_counter() - start
        cpu = time.process_time() - cpu + children_cpu_s() - child_cpu
    docs = ds.manifest.documents.total
    text_tokens = ds.manifest.counts.tokens - 2 * docs  # without <bos>/<eos>
    return text_tokens / seconds, text_tokens, seconds, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="also write the Markdown here")
    args = ap.parse_args()
    lines = [
        "# Precook benchmark",
        "",
        f"- machine: {machine()}; shared with other jobs while measured (load average "
        f"{os.getloadavg()[0]:.1f} at the start), so the rounds alternate the two sides",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- python {platform.python_version()}, numpy {np.__version__}",
        "- corpus: the Python standard library (*.py, without site-packages)",
        "- command: `PYTHONPATH=.:.gen python3 trainer/bench/precook_bench.py "
        "--out trainer/bench/precook_results.md`",
        "",
    ]
    texts = stdlib_texts()
    with tempfile.TemporaryDirectory() as tmp:
        print("training the BPE tokenizer (vocab 4096) used by both sides...", file=sys.stderr)
        tok = tokenizer.train_bpe(texts, 4096)
        tok.save(tmp)
        tok_json = os.path.join(tmp, tokenizer.HF_FILE)
        lines += [
            "## 1. End-to-end precook vs the tokenizer's own batch encode",
            "",
            f"{len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} M characters. Precook: "
            "`precook_dataset` (bpe_file, best_fit, T=4096, workers = CPUs, empty cache): hash "
            "inputs, read files, tokenize in worker processes, pack, write shards and manifest. "
            "Tokenizer: the same tokenizer.json, texts already in memory, all cores. Wall-clock "
            "throughput swings with the other jobs' load, so the CPU cost per token (this "
            "process and its workers, from getrusage) is shown too: it does not.",
            "",
            "| round | load avg | tokenizer batch encode | precook end to end | throughput ratio "
            "| CPU-time ratio |",
            "|---|---|---|---|---|---|",
        ]
        ratios, cpu_ratios = [], []
        for round_ in range(1, args.rounds + 1):
            base, n_base, api, base_cpu = baseline(tok_json, texts)
            rate, n_pre, seconds, cpu = precook_run(tok_json)
            if n_base != n_pre:
                raise SystemExit(f"token counts differ: tokenizer {n_base}, precook {n_pre}")
            ratios.append(rate / base)
            cpu_ratios.append(base_cpu / cpu)  # tokens per CPU-second, precook / tokenizer
            lines.append(
                f"| {round_} | {os.getloadavg()[0]:.1f} | {base / 1e6:.2f} M tokens/s ({api}, "
                f"{base_cpu:.1f} CPU-s) | {rate / 1e6:.2f} M tokens/s ({seconds:.1f} s, "
                f"{cpu:.1f} CPU-s) | {rate / base:.2f} | {base_cpu / cpu:.2f} |"
            )
            print(lines[-1], file=sys.stderr)
        lines += [
            "",
            f"Median throughput ratio: **{statistics.median(ratios):.2f}** (goal >= 0.8); "
            f"median CPU-time ratio (tokenizer CPU-seconds / precook CPU-seconds for the same "
            f"text): **{statistics.median(cpu_ratios):.2f}**. Both sides produced the same "
            f"{n_base:,} text tokens.",
            "",
        ]
        lengths = np.array([len(t) for t in tok.encode_batch(texts)]) + 2  # <bos> ... <eos>

    rng = np.random.default_rng(0)
    synthetic = rng.choice(lengths, size=1_000_000, replace=True)
    lines += [
        "## 2. best_fit on 1,000,000 documents",
        "",
        "Lengths drawn with replacement (seed 0) from the standard library's real document "
        f"lengths in tokens (median {int(np.median(synthetic)):,}, max {synthetic.max():,}); "
        f"{synthetic.sum() / 1e9:.2f} G tokens in all.",
        "",
        "| T | seconds | documents/s | rows | efficiency (%) |",
        "|---|---|---|---|---|",
    ]
    for seq_len in (4096, 8192):
        start = time.perf_counter()
        plan = packing.pack("best_fit", synthetic, seq_len)
        seconds = time.perf_counter() - start
        eff = 100 * plan.target_tokens / plan.slots
        lines.append(
            f"| {seq_len} | {seconds:.2f} | {1e6 / seconds / 1e3:,.0f} k | {plan.rows:,} | "
            f"{eff:.3f} |"
        )
        print(lines[-1], file=sys.stderr)
    lines += [
        "",
        "## 3. Packing efficiency on the standard library",
        "",
        f"{len(lengths):,} documents, {lengths.sum():,} tokens (BPE 4096, <bos> text <eos>). "
        "Efficiency = tokens with a training target / slots computed (goal for best_fit: "
        ">= 99%).",
        "",
        "| T | strategy | rows | padding waste (%) | efficiency (%) | truncated (%) |",
        "|---|---|---|---|---|---|",
    ]
    for r in analyze.analyze_lengths(lengths, [4096, 8192]):
        lines.append(
            f"| {r['seq_len']} | {r['strategy']} | {r['rows']:,} | {r['padding_waste_pct']:.2f} "
            f"| {r['packing_efficiency_pct']:.2f} | {r['truncated_pct']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
