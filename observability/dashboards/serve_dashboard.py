"""The serve dashboard: is this serve job answering, and how fast? Fed by the launcher's
/metrics (the job's heartbeat: load, KV blocks, latency quantiles of the last window); the
serve job's own /metrics has the full histograms (docs/serve.md)."""

from grafana_foundation_sdk.models.dashboard import Dashboard

from observability.dashboards.catalog_panels import LEGEND, add_rows, series
from observability.dashboards.panels import (
    kitchen_dashboard,
    multi_value_variable,
    stat_panel,
    target,
    timeseries_panel,
)
from protos import metric_panels
from protos.metric_catalog import metric
from protos.metric_panels import Board

UID = Board.SERVE.value
RUNNING = series("running_requests")
WAITING = series("waiting_requests")
USED = series("kv_blocks_used")
FREE = series("kv_blocks_free")
KV_USE = f"{USED} / clamp_min({USED} + {FREE}, 1)"
# The prefix cache's hit rate: prompt tokens read from it over prompt tokens admitted.
CACHED, PROMPT = series("prefix_cached_tokens"), series("prompt_tokens")
HIT_RATE = f"rate({CACHED}[5m]) / clamp_min(rate({PROMPT}[5m]), 1)"
# Speculative decoding's acceptance rate: draft tokens kept over draft tokens proposed.
KEPT, DRAFTED = series("spec_accepted_tokens"), series("spec_draft_tokens")
ACCEPTANCE = f"rate({KEPT}[5m]) / clamp_min(rate({DRAFTED}[5m]), 1)"
# Structured output's grammar time per token: seconds over masked positions. No constrained
# request in the window: no point (0/0), not a misleading 0.
GRAMMAR_SECONDS, GRAMMAR_TOKENS = series("grammar_seconds"), series("grammar_tokens")
GRAMMAR_PER_TOKEN = f"rate({GRAMMAR_SECONDS}[5m]) / rate({GRAMMAR_TOKENS}[5m])"


def _at_a_glance() -> list:
    """One row of stat panels, 24 grid units wide."""
    return [
        stat_panel("Running", "Requests in the continuous batch now.", "none", RUNNING, LEGEND, 3),
        stat_panel("Waiting", "Requests queued or preempted, waiting.", "none", WAITING, LEGEND, 3),
        stat_panel(
            "Tokens/s",
            "Generated tokens per second, all requests.",
            "short",
            series("generated_tokens_per_second"),
            LEGEND,
            4,
        ),
        stat_panel(
            "TTFT p99",
            "Time to first token, p99 of the last window.",
            "s",
            series("ttft_p99_seconds"),
            LEGEND,
            4,
        ),
        stat_panel(
            "KV cache used",
            "Share of the paged KV-cache blocks in use.",
            "percentunit",
            KV_USE,
            LEGEND,
            4,
        ),
        stat_panel(
            "Prefix cache hits",
            "Share of the prompt tokens read from the prefix cache (5 min). Healthy: near the "
            "share of the prompts that is common (a system prompt); near 0 with a common "
            "prompt: the prompts differ before it (a date, a user name first).",
            "percentunit",
            HIT_RATE,
            LEGEND,
            3,
        ),
        stat_panel(
            "Draft acceptance",
            "Share of speculative decoding's draft tokens the model kept (5 min; 0 with "
            "serve.speculative_tokens 0). Each kept token is a step saved; near 0 with drafts: "
            "the draft does not predict the model (prompt lookup on answers that do not repeat "
            "their context, or a draft model trained on other data), turn it off.",
            "percentunit",
            ACCEPTANCE,
            LEGEND,
            3,
        ),
    ]


def _features() -> list:
    """The serving features' timeseries (SERVE_LOAD row): what each saves or costs."""
    return [
        timeseries_panel(
            "Prefix cache: cached tokens/s and hit rate",
            "Prompt tokens per second read from the prefix cache instead of computed, beside "
            "all prompt tokens admitted; the hit rate is their ratio (right: the At a glance "
            "stat). A drop with unchanged traffic: the prompts now differ before their common "
            "part (KitchenServePrefixCacheHitsDropped).",
            "short",
            [
                target(f"rate({CACHED}[5m])", "cached " + LEGEND, "A"),
                target(f"rate({PROMPT}[5m])", "prompt " + LEGEND, "B"),
            ],
            min_value=0,
        ),
        timeseries_panel(
            "Speculative decoding: draft tokens/s and acceptance",
            "Draft tokens proposed and kept per second. Kept over proposed is the acceptance "
            "rate; near 0 with drafts proposed, every draft is computed for nothing "
            "(KitchenServeDraftsRejected).",
            "short",
            [
                target(f"rate({DRAFTED}[5m])", "drafted " + LEGEND, "A"),
                target(f"rate({KEPT}[5m])", "kept " + LEGEND, "B"),
            ],
            min_value=0,
        ),
        timeseries_panel(
            "Structured output: grammar time per token",
            "Seconds the grammars of response_format requests took (token masks, draft checks, "
            "compiling) per masked token. Healthy: well under a millisecond, a small share of "
            "the inter-token latency; above 5 ms the masks, computed inside the engine's "
            "step, slow every stream (KitchenServeGrammarSlow). No point: no constrained "
            "request in the window.",
            "s",
            [target(GRAMMAR_PER_TOKEN, LEGEND, "A")],
            min_value=0,
        ),
    ]


def build() -> Dashboard:
    board = kitchen_dashboard(
        UID,
        "Kitchen serve",
        "One serve job (kind: serve): requests, latency, throughput, KV-cache blocks, "
        "preemptions. Guide: docs/serve.md",
    ).with_variable(
        multi_value_variable(
            "job_id", "Job", f"label_values({metric('kv_blocks_free').name}, job_id)"
        )
    )
    derived = {metric_panels.SERVE_GLANCE: _at_a_glance(), metric_panels.SERVE_LOAD: _features()}
    return add_rows(board, Board.SERVE, derived).build()
