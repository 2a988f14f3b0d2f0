"""StepHistogram exposes exactly what prometheus_client's Histogram exposes for the same
observations (the dashboards and alerts read these series)."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from trainer.serve.metrics import LATENCY_BUCKETS, ServeMetrics, StepHistogram

VALUES = [0.001, 0.005, 0.0051, 0.3, 1.0, 200.0, 0.05, 0.05]  # bucket edges included


def test_step_histogram_matches_prometheus_clients_histogram():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "doc", ["model_name"], registry=theirs, buckets=LATENCY_BUCKETS)
    for v in VALUES:
        h.labels("m").observe(v)
    step = StepHistogram("x_seconds", "doc", {"model_name": "m"}, ours, LATENCY_BUCKETS)
    step.observe_many(VALUES[:3])  # two steps' worth
    step.observe_many(VALUES[3:])
    expected = [
        line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line
    ]
    assert generate_latest(ours).decode().splitlines() == expected


def test_serve_metrics_expose_the_latency_histograms():
    m = ServeMetrics("tiny")
    m.inter_token_latency.observe_many([0.002, 0.02])
    m.time_to_first_token.observe(0.3)
    text = generate_latest(m.registry).decode()
    assert 'kitchen_serve_inter_token_latency_seconds_count{model_name="tiny"} 2.0' in text
    assert (
        'kitchen_serve_inter_token_latency_seconds_bucket{le="0.005",model_name="tiny"} 1.0' in text
    )
    assert 'kitchen_serve_time_to_first_token_seconds_sum{model_name="tiny"} 0.3' in text
