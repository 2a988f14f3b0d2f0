"""Mixture-of-experts series for the launcher's /metrics (trainer/moe.py reports them).

From the latest progress record that carries MoE statistics (evaluation records do not, and
must not reset a gauge that an alert watches):
  kitchen_train_moe_max_imbalance        the worst layer's max/mean tokens per expert (1 = even)
  kitchen_train_moe_dropped_ratio        routed assignments dropped at capacity, 0-1
  kitchen_train_moe_min_router_entropy   the lowest layer's mean router entropy / ln(experts)
  kitchen_train_moe_layer_imbalance{layer}, kitchen_train_moe_layer_aux_loss{layer}
Labels: the job's (launcher/metrics.py JOB_LABELS), plus `layer` for the per-layer ones.
"""

from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily

from protos import progress_pb2

# (metric, help, Progress field)
GAUGES = [
    (
        "kitchen_train_moe_max_imbalance",
        "Worst MoE layer's max/mean tokens per expert (1 = even; experts/top_k = collapsed).",
        "moe_max_imbalance",
    ),
    (
        "kitchen_train_moe_dropped_ratio",
        "Share of routed assignments dropped at expert capacity.",
        "moe_dropped_fraction",
    ),
    (
        "kitchen_train_moe_min_router_entropy",
        "Lowest MoE layer's mean router entropy over ln(experts), 0-1.",
        "moe_min_router_entropy",
    ),
]
# (metric, help, MoeLayerStats field)
LAYER_GAUGES = [
    ("kitchen_train_moe_layer_imbalance", "Max/mean tokens per expert, per layer.", "imbalance"),
    ("kitchen_train_moe_layer_aux_loss", "Load-balancing loss E·sum f·P (1 = even).", "aux_loss"),
]


def families(
    jobs: Iterable[tuple[list[str], progress_pb2.Progress | None]], job_labels: list[str]
) -> Iterator:
    """The MoE metric families for (label values, latest MoE Progress or None) per job."""
    gauges = {name: GaugeMetricFamily(name, doc, labels=job_labels) for name, doc, _ in GAUGES}
    layer_labels = [*job_labels, "layer"]
    per_layer = {
        name: GaugeMetricFamily(name, doc, labels=layer_labels) for name, doc, _ in LAYER_GAUGES
    }
    for labels, p in jobs:
        if p is None:
            continue
        for name, _, field in GAUGES:
            gauges[name].add_metric(labels, getattr(p, field))
        for layer in p.moe_layers:
            for name, _, field in LAYER_GAUGES:
                per_layer[name].add_metric([*labels, str(layer.layer)], getattr(layer, field))
    yield from gauges.values()
    yield from per_layer.values()
