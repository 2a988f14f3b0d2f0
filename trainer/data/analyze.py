"""What packing buys: every strategy at every sequence length, measured on a real corpus.

Only document lengths matter, so the corpus is tokenized once (cached, shared with
`precook build`) and each strategy is planned, not written. Definitions, per (strategy, T):

- padding waste:      padding slots / all slots computed.
- packing efficiency: tokens trained on (they have a next-token target in their row) / all
                      slots. Below 100 - waste by one token per document piece in a row.
- truncated:          tokens dropped (pad and bucket cut documents longer than T) / all tokens.
- split documents:    documents whose tokens end up in more than one piece (concat cuts them at
                      row ends, best_fit chunks those longer than T).
- attention FLOPs per useful token: dense causal attention of a training step costs
  12 * T^2 FLOPs per row, per layer and per unit of model width (PaLM appendix B: 12*L*H*Q*T
  per token); divided by the useful tokens. With attention masked to each document (and a
  kernel that skips the masked blocks) a row costs 12 * sum(piece^2) instead.
"""

import io
import os

import numpy as np

from protos import files
from protos.trainer_config_pb2 import DataConfig
from trainer.data import packing
from trainer.data.mixture import plan_sources
from trainer.data.progress import Say
from trainer.data.tokenized import tokenize_corpus

MEANING = (
    "Padding waste = share of computed slots that are padding; efficiency = share of slots "
    "holding a token the model learns from; truncated = tokens cut and never trained on; "
    "attention FLOPs per useful token (x layers x model width) grow with the row length T, so "
    "long rows cost more per token unless attention is masked per document."
)


def measure(plan: packing.PackPlan, documents: int) -> dict:
    slots, useful = plan.slots, max(plan.target_tokens, 1)
    pieces = np.bincount(plan.seg_doc, minlength=documents)
    return {
        "seq_len": plan.seq_len,
        "strategy": plan.strategy,
        "rows": plan.rows,
        "slots": slots,
        "tokens": plan.kept_tokens,
        "padding_tokens": plan.padding_tokens,
        "truncated_tokens": plan.truncated_tokens,
        "target_tokens": plan.target_tokens,
        "padding_waste_pct": 100 * plan.padding_tokens / slots,
        "packing_efficiency_pct": 100 * plan.target_tokens / slots,
        "truncated_pct": 100 * plan.truncated_tokens / max(plan.input_tokens, 1),
        "split_documents_pct": 100 * float((pieces > 1).sum()) / max(documents, 1),
        "attention_flops_per_useful_token": 12 * float((plan.capacity**2).sum()) / useful,
        "attention_flops_per_useful_token_doc_masked": (
            12 * float((plan.seg_len**2).sum()) / useful
        ),
    }


def analyze_lengths(lengths, seq_lens, strategies=packing.STRATEGIES) -> list[dict]:
    lengths = np.asarray(lengths, dtype=np.int64)
    return [
        measure(packing.pack(s, lengths, t), len(lengths)) for t in seq_lens for s in strategies
    ]


def corpus_summary(lengths: np.ndarray) -> dict:
    q = np.percentile(lengths, [50, 90, 99]).round().astype(int).tolist()
    return {
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "median_tokens": q[0],
        "p90_tokens": q[1],
        "p99_tokens": q[2],
        "max_tokens": int(lengths.max()),
    }


def _k(x: float) -> str:
    return f"{x / 1e3:,.1f} k"


def takeaway(results: list[dict]) -> str:
    """One sentence from the numbers: pad vs best_fit at the longest T, and what T costs."""
    by = {(r["seq_len"], r["strategy"]): r for r in results}
    lo, hi = min(r["seq_len"] for r in results), max(r["seq_len"] for r in results)
    if (hi, "pad") not in by or (hi, "best_fit") not in by:
        return ""
    pad, best = by[(hi, "pad")], by[(hi, "best_fit")]
    text = (
        f"At T={hi:,}, pad learns from {pad['packing_efficiency_pct']:.1f}% of the slots it "
        f"computes and truncates {pad['truncated_pct']:.1f}% of tokens; best_fit learns from "
        f"{best['packing_efficiency_pct']:.1f}% and truncates none."
    )
    if lo != hi and (lo, "best_fit") in by:
        small = by[(lo, "best_fit")]
        dense = best["attention_flops_per_useful_token"] / small["attention_flops_per_useful_token"]
        masked = (
            best["attention_flops_per_useful_token_doc_masked"]
            / small["attention_flops_per_useful_token_doc_masked"]
        )
        text += (
            f" Packed rows of {hi:,} cost {dense:.1f}x the attention FLOPs per useful token of "
            f"rows of {lo:,} ({masked:.1f}x with per-document masking)."
        )
    return text


def format_table(report: dict) -> str:
    c = report["corpus"]
    lines = [
        f"corpus: {c['description']}",
        f"  {c['documents']:,} documents, {c['tokens']:,} tokens ({report['tokenizer']}); "
        f"tokens per document: median {c['median_tokens']:,}, p90 {c['p90_tokens']:,}, "
        f"p99 {c['p99_tokens']:,}, max {c['max_tokens']:,}",
        "",
        f"{'T':>6}  {'strategy':<8} {'rows':>9}  {'padding':>8}  {'efficiency':>10}  "
        f"{'truncated':>9}  {'split docs':>10}  {'attn FLOPs/useful token':>25}",
        f"{'tokens':>6}  {'':<8} {'':>9}  {'waste %':>8}  {'%':>10}  {'% tokens':>9}  "
        f"{'% docs':>10}  {'dense':>12} {'doc-masked':>12}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['seq_len']:>6}  {r['strategy']:<8} {r['rows']:>9,}  "
            f"{r['padding_waste_pct']:>8.1f}  {r['packing_efficiency_pct']:>10.2f}  "
            f"{r['truncated_pct']:>9.1f}  {r['split_documents_pct']:>10.1f}  "
            f"{_k(r['attention_flops_per_useful_token']):>12} "
            f"{_k(r['attention_flops_per_useful_token_doc_masked']):>12}"
        )
    lines += ["", MEANING, takeaway(report["results"])]
    if report.get("plot"):
        lines.append(f"document length histogram: {report['plot']}")
    return "\n".join(line for line in lines)


def plot_lengths(lengths: np.ndarray, seq_lens, path: str, title: str) -> None:
    """Histogram of document lengths (log scale) with each sequence length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    top = max(int(lengths.max()), max(seq_lens)) * 1.5
    bins = np.geomspace(max(1, int(lengths.min())), top, 60)
    ax.hist(lengths, bins=bins, color="#4c72b0", alpha=0.85)
    ax.set_xscale("log")
    for t in seq_lens:
        longer = 100 * float((lengths > t).mean())
        ax.axvline(t, color="#c44e52", linestyle="--", linewidth=1.2)
        label = f"T={t:,}: {longer:.0f}% of docs longer"
        box = {"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1}
        ax.text(
            t,
            ax.get_ylim()[1] * 0.97,
            label,
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            bbox=box,
        )
    ax.set_xlabel("document length (tokens, log scale)")
    ax.set_ylabel("documents")
    # Where the tokens are: long documents hold most of them, which is what truncation drops.
    ordered = np.sort(lengths)
    share = ax.twinx()
    share.plot(ordered, 100 * np.cumsum(ordered) / ordered.sum(), color="#55a868", linewidth=1.5)
    share.set_ylim(0, 100)
    share.set_ylabel("% of all tokens in documents up to this length", color="#55a868")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    files.write_atomic(path, buf.getvalue())


def analyze(
    cfg: DataConfig,
    cache_dir: str,
    seq_lens: list[int],
    plot_path: str | None,
    show_progress: bool,
    say: Say,
) -> dict:
    """The report `precook analyze` prints, for a resolved DataConfig."""
    from trainer.data.cache import Cache

    plan = plan_sources(cfg)
    path, found, hit = tokenize_corpus(cfg, plan, Cache(cache_dir), show_progress, say)
    if hit:
        say(f"tokenized corpus found in the cache: {path}")
    lengths = np.diff(np.load(os.path.join(path, "doc_offsets.npy")))
    tok = found.tokenizer
    tok_name = f"{tok.kind} tokenizer, {tok.vocab_size:,} ids, <bos> text <eos>"
    results = analyze_lengths(lengths, seq_lens)
    report = {
        "corpus": {"description": plan.description, **corpus_summary(lengths)},
        "tokenizer": tok_name,
        "results": results,
        "meaning": MEANING,
        "plot": None,
        "takeaway": takeaway(results),
    }
    if plot_path:
        plot_lengths(lengths, seq_lens, plot_path, f"Document lengths: {plan.description}")
        report["plot"] = os.path.abspath(plot_path)
    return report
