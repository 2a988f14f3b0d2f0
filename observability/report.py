"""`kitchen report`: one run as a self-contained HTML page, for people without Grafana.

    bazel run //observability:report -- RUN_DIR [--output report.html]

Reads RUN_DIR/metrics.jsonl (kitchen.v1.Progress per logged step) and writes summary numbers,
what looks wrong (observability/run_health.py) and PNG charts of loss, MFU, step time,
throughput and goodput, embedded so the page can be mailed or attached as one file.
"""

import argparse
import base64
import html
import sys
from pathlib import Path

import numpy as np

from observability.report_plots import all_plots
from observability.run_health import findings
from observability.run_series import run_series
from protos.files import write_atomic
from protos.paths import user_path
from protos.progress_log import ProgressLogError, read_progress_log

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60em; margin: 2em auto; color: #222; }
table { border-collapse: collapse; } td, th { padding: 0.2em 1em 0.2em 0; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.problem { color: #b00020; } .note { color: #8a6d00; } .ok { color: #1b5e20; }
img { max-width: 100%; } .muted { color: #777; }
"""


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{prefix} {unit}"
    return f"{value:.3g} {unit}"


def _first(records, field: str, reverse: bool = False):
    for record in reversed(records) if reverse else records:
        if getattr(record, field):
            return getattr(record, field)
    return None


def summary_rows(records: list, series) -> list[tuple[str, str]]:
    """(label, value with unit) for the summary table; a quantity the run did not log is left
    out rather than shown as 0."""
    v = series.values
    step_time = v["step_time_seconds"]
    last_step = int(series.steps[-1]) if len(series.steps) else 0
    total = max(r.total_steps for r in records)
    finite_loss = v["loss"][np.isfinite(v["loss"])]
    rows = [
        ("Job", _first(records, "job_id") or "(run outside the launcher)"),
        ("Steps", f"{last_step:,} of {total:,}" if total else f"{last_step:,}"),
        ("Attempts", str(max(max(r.attempt for r in records), 1))),
        ("Tokens trained", _si(max(r.tokens_total for r in records), "tokens")),
    ]
    if len(finite_loss):
        rows.append(("Final loss", f"{finite_loss[-1]:.4f}"))
    if len(series.eval_loss):
        rows.append(("Best eval loss", f"{series.eval_loss.min():.4f}"))
    if len(step_time):
        data_share = np.median(v["data_time_seconds"] / np.maximum(step_time, 1e-12))
        rows += [
            ("Throughput (median)", _si(float(np.median(v["tokens_per_second"])), "tokens/s")),
            (
                "Step time p50 / p99",
                f"{np.percentile(step_time, 50):.3g} s / {np.percentile(step_time, 99):.3g} s",
            ),
            ("Waiting for data (median share of a step)", f"{data_share:.1%}"),
        ]
    if np.any(v["mfu"] > 0):
        basis = _first(records, "mfu_basis", reverse=True) or "unknown basis"
        rows.append(("MFU (median)", f"{np.median(v['mfu']):.1%} (peak from {basis})"))
    if np.any(v["goodput"] > 0):
        rows.append(("Goodput (latest)", f"{v['goodput'][-1]:.1%}"))
    if np.any(v["peak_memory_bytes"] > 0):
        rows.append(("Peak memory", f"{v['peak_memory_bytes'].max() / 2**30:.2f} GiB"))
    if len(step_time):
        rows.append(("Padding (mean)", f"{v['padding_fraction'].mean():.1%} of tokens"))
    rows.append(
        (
            "Skipped steps / rollbacks",
            f"{max(r.skipped_steps for r in records)} / {max(r.rollbacks for r in records)}",
        )
    )
    return rows


def render_html(run: str | Path) -> tuple[str, list[str]]:
    """The report page for a run directory (or metrics.jsonl), and warnings met reading it."""
    log = read_progress_log(run)
    if not log.records:
        raise ProgressLogError(f"{log.path}: no progress records")
    series = run_series(log.records)
    rows = summary_rows(log.records, series)
    title = f"Kitchen run report: {rows[0][1]}"
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
        f"<style>{STYLE}</style></head><body><h1>{e(title)}</h1>",
        f"<p class='muted'>From {e(str(log.path))}: {len(log.records)} records, "
        f"{len(series.steps)} training steps.</p><h2>Summary</h2><table>",
        *(f"<tr><th>{e(k)}</th><td class='num'>{e(v)}</td></tr>" for k, v in rows),
        "</table><h2>What to look at</h2>",
    ]
    found = findings(series)
    if not found:
        parts.append(
            "<p class='ok'>Nothing unusual: finite loss without lasting spikes, steady "
            "MFU and step time, no input stalls, no restarts.</p>"
        )
    parts += [f"<p class='{f.severity}'><b>{e(f.title)}.</b> {e(f.detail)}</p>" for f in found]
    parts.append("<h2>Charts</h2>")
    for chart_title, png in all_plots(series, _first(log.records, "mfu_basis", True) or ""):
        if png is None:
            parts.append(f"<p class='muted'>{e(chart_title)}: not logged by this run.</p>")
            continue
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<img alt='{e(chart_title)}' src='data:image/png;base64,{data}'>")
    if series.events:
        parts.append("<h2>Events</h2><table><tr><th>step</th><th>attempt</th><th>event</th></tr>")
        parts += [
            f"<tr><td class='num'>{s}</td><td class='num'>{a}</td><td>{e(m)}</td></tr>"
            for s, a, m in series.events[-100:]
        ]
        parts.append("</table>")
    for warning in log.warnings:
        parts.append(f"<p class='note'>{e(warning)}</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts), log.warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kitchen report", description=__doc__.split("\n")[0])
    parser.add_argument("run", help="run directory (or its metrics.jsonl)")
    parser.add_argument("--output", "-o", help="HTML file (default: RUN_DIR/report.html)")
    args = parser.parse_args(argv)
    run = Path(user_path(args.run))  # `bazel run` starts us in the runfiles, not where you are
    output = Path(user_path(args.output)) if args.output else (run if run.is_dir() else run.parent)
    if output.is_dir():
        output = output / "report.html"
    try:
        page, warnings = render_html(run)
    except (FileNotFoundError, ProgressLogError) as err:
        print(f"kitchen report: {err}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    write_atomic(str(output), page)
    print(f"wrote {output} ({len(page) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
