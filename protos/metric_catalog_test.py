"""The catalog covers every numeric field of Progress (and of its per-rank and per-layer
messages) exactly once: exported, or listed as not exported with a reason."""

import re

import pytest
from google.protobuf.descriptor import FieldDescriptor

from protos import job_pb2, metric_catalog, metric_panels, progress_pb2
from protos.metric_catalog import CATALOG, NOT_EXPORTED, Series, Source

_MESSAGES = {
    Source.PROGRESS: progress_pb2.Progress.DESCRIPTOR,
    Source.RANK: progress_pb2.RankHealth.DESCRIPTOR,
    Source.MOE_LAYER: progress_pb2.MoeLayerStats.DESCRIPTOR,
}
_NUMERIC = {
    FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT32,
    FieldDescriptor.CPPTYPE_UINT64, FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT,
}  # fmt: skip


def _numeric_fields(source: Source) -> set[str]:
    return {
        f.name for f in _MESSAGES[source].fields if f.cpp_type in _NUMERIC and not f.is_repeated
    }


def test_every_numeric_field_is_exported_or_says_why_not():
    for source in Source:
        exported = [m.field for m in metric_catalog.metrics(source)]
        assert len(exported) == len(set(exported)), f"{source.value}: a field listed twice"
        skipped = {field for src, field in NOT_EXPORTED if src == source}
        fields = _numeric_fields(source)
        assert set(exported) | skipped == fields, (
            f"{source.value}: not in the catalog nor NOT_EXPORTED: "
            f"{sorted(fields - set(exported) - skipped)}; unknown: "
            f"{sorted((set(exported) | skipped) - fields)}"
        )
        assert not set(exported) & skipped, f"{source.value}: both exported and not"
    assert all(len(reason) > 15 for reason in NOT_EXPORTED.values())


def test_names_help_and_kinds_are_well_formed():
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names)), "a Prometheus name used twice"
    kinds = set(job_pb2.JobKind.values()) - {job_pb2.JOB_KIND_UNSPECIFIED}
    for m in CATALOG:
        assert re.fullmatch(r"kitchen_[a-z0-9_]+", m.name) and not m.name.endswith("_total"), m
        assert m.help.endswith(".") and len(m.help) > 10, m.name
        assert set(m.kinds) <= kinds, m.name
        # Per-rank and per-layer series are the latest message's values, nothing else.
        if m.source != Source.PROGRESS:
            assert m.series in (Series.LATEST, Series.MOE), m.name


def test_every_panel_draws_at_least_one_metric_on_a_known_row():
    declared = [p for p in vars(metric_panels).values() if isinstance(p, metric_panels.Panel)]
    drawn = {m.panel for m in CATALOG if m.panel is not None}
    assert set(declared) == drawn, "a panel no metric names (or one not declared)"
    for panel in drawn:
        assert panel.row in metric_panels.ROWS, panel.title
        assert len(panel.help) > 20 and panel.unit, panel.title
        legends = [m.legend for m in metric_catalog.panel_metrics(panel)]
        assert len(legends) == len(set(legends)), f"{panel.title}: two targets, one legend"


def test_a_lookup_names_the_missing_field():
    assert metric_catalog.metric("loss").name == "kitchen_train_loss"
    assert metric_catalog.metric("step_time_seconds", Source.RANK).name.endswith(
        "rank_step_seconds"
    )
    with pytest.raises(KeyError, match=r"Progress\.update_seconds"):
        metric_catalog.metric("update_seconds")  # #30: PPO no longer reports it
