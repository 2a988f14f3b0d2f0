"""Hostile specs over raw gRPC (seeded, so a failure replays): the launcher answers each with
a job or an error naming the field, never an internal error; the control loop never fails;
every accepted job ends; a well-behaved job submitted alongside them succeeds. On both stores:
SQLite, and a real PostgreSQL 15 started for the module."""

import logging
import math
import os
import random

import grpc
import pytest

from launcher.testdata import harness as h
from launcher.testdata.postgres import running_postgres
from protos import job_pb2, launcher_pb2

SEED = 20261201
SPECS = 120
SUBMIT = "/kitchen.v1.Launcher/SubmitJob"
BIG = 2**31 - 1

# (field path under JobSpec, hostile values): out of range, not finite, not an enum member,
# huge, Unicode lookalikes, NUL, paths into the launcher's own state.
HOSTILE: dict[str, list] = {
    "retry.backoff_seconds": [math.nan, math.inf, 1e12, -1.0],
    "retry.max_backoff_seconds": [math.nan, -math.inf, 1e300],
    "retry.max_attempts": [-5, BIG],
    "hang_timeout_seconds": [math.nan, -math.inf, 1e300, -1.0],
    "kind": [0, 99, -3],
    "name": ["", "x" * 1_000_000, "a/b", "\u0661\u0662\u0663", "nul\x00", "-lead"],
    "team": ["../x", "t" * 100, "\u202e"],
    "priority": [BIG, -BIG - 1],
    "resources.nodes": [BIG, -1],
    "resources.gpus_per_node": [10**6, -2],
    "resources.processes_per_node": [BIG, -1],
    "resources.pool": ["nope", "\u202e", "x" * 5000],
    "image": ["x" * 5000, "/nonexistent", "registry/name:latest"],
    "trainer.train.steps": [0, -1, BIG],
    "trainer.train.micro_batch": [BIG, 0],
    "trainer.train.dtype": ["fp8", "\x00"],
    "trainer.model.dim": [BIG, 7, 0],
    "trainer.model.n_layers": [0, BIG],
    "trainer.data.seq_len": [BIG, 1],
    "trainer.data.packing": [77],
    "trainer.optim.lr": [math.nan, -math.inf, 0.0],
    "trainer.generate.top_p": [math.nan, 2.0],
    "trainer.data.input": ["relative/path", "/etc/passwd"],
    "trainer.data.cache_dir": ["{state}/state.db", "{state}/runs/j999999"],
}
# Odd but valid: at the edges of every range. A spec with only these must be accepted and run.
EDGE: dict[str, list] = {
    "priority": [1000, -1000],
    "retry.max_attempts": [100, 1],
    "retry.backoff_seconds": [0.0, 1e-9],
    "hang_timeout_seconds": [30 * 86400.0, 0.0],
    "name": ["n" * 63, "0.-_"],
    "team": ["t" * 63, ""],
    "trainer.train.steps": [1, 3],
    "trainer.data.input": ["/etc/passwd"],  # a single-user launcher lets its user read it
    "trainer.model.n_kv_heads": [1],
}


def _set(spec, path, value, state):
    *sections, name = path.split(".")
    message = spec
    for section in sections:
        message = getattr(message, section)
    if isinstance(value, str):
        value = value.replace("{state}", state)
    setattr(message, name, value)


def hostile_requests(rng: random.Random, state: str):
    """(what was changed, serialized SubmitJobRequest): a small valid job, then 0-2 edge
    values and 0-3 hostile ones; every fourth spec also carries a field this schema does not
    have."""
    for i in range(SPECS):
        spec = h.spec(f"fuzz-{i}", steps=2)
        edges = rng.sample(sorted(EDGE), rng.randint(0, 2))
        picked: list[tuple[str, object]] = [(p, rng.choice(EDGE[p])) for p in edges]
        hostile = rng.sample(sorted(HOSTILE), rng.choice((0, 1, 1, 2, 3)))
        picked += [(path, rng.choice(HOSTILE[path])) for path in hostile]
        for path, value in picked:
            _set(spec, path, value, state)
        if i % 4 == 3:  # field 999 (varint 1): kept by proto3 as unknown, and refused
            spec.ParseFromString(spec.SerializeToString() + bytes([0xB8, 0x3E, 0x01]))
            picked.append(("(unknown field 999)", 1))
        body = launcher_pb2.SubmitJobRequest(spec=spec, request_id=f"fuzz-{i}")
        yield [(p, repr(v)[:40]) for p, v in picked], body.SerializeToString()


@pytest.fixture(scope="module")
def postgres_server():
    with running_postgres() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def launcher(request, tmp_path, monkeypatch):
    """A launcher on each store: what one stores and the other refuses shows here."""
    cfg = h.config(tmp_path, nodes=2)
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        monkeypatch.setenv("KITCHEN_PG_DSN", server.create_database(f"fuzz{os.getpid()}"))
        cfg.store.postgres.dsn_env = "KITCHEN_PG_DSN"
    with h.started(cfg) as (launcher, client):
        yield launcher, client, cfg


def test_hostile_specs_never_stop_the_launcher(launcher, caplog):
    server, client, cfg = launcher
    caplog.set_level(logging.WARNING, logger="kitchen.launcher")
    victim = client.submit(h.spec("victim", steps=20))
    submit = client.channel.unary_unary(
        SUBMIT, request_serializer=None,
        response_deserializer=launcher_pb2.SubmitJobResponse.FromString,
    )  # fmt: skip
    accepted, refused = [], []
    for picked, raw in hostile_requests(random.Random(SEED), cfg.state_dir):
        try:
            accepted.append((picked, submit(raw, timeout=30).job))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (picked, e.code(), e.details())
            assert len(e.details()) < 1000 and e.details().startswith("spec."), (picked, e)
            refused.append(picked)
    assert len(refused) >= SPECS // 2 and len(accepted) >= 10, (len(refused), len(accepted))
    with pytest.raises(grpc.RpcError) as nul:
        client.submit(h.spec("nul-key"), request_id="retry\x00me")
    assert (nul.value.code(), nul.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "request_id: contains a NUL character",
    )  # fmt: skip
    for _, job in accepted:  # what passed the rules is a job that can run: it ends
        h.wait_for(client, job.id, h.FINAL, timeout=60)
    assert h.wait_for(client, victim.id, h.FINAL, timeout=60).state == job_pb2.SUCCEEDED
    failures = [r for r in caplog.records if "loop iteration failed" in r.getMessage()]
    assert not failures, failures[0].getMessage()
