"""Bearer tokens (users, teams, admins), trainer tokens, and TLS with a throwaway certificate."""

import subprocess

import grpc
import pytest

from launcher import health
from launcher.client import Client
from launcher.testdata import harness as h
from protos import job_pb2, progress_pb2

TOKENS = """
tokens:
  - {token: alice-token, user: alice, team: nlp}
  - {token: bob-token, user: bob, team: vision}
  - {token: root-token, user: ops, team: infra, admin: true}
"""


def tokens_file(tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text(TOKENS)
    return str(path)


@pytest.fixture
def secured(tmp_path):
    launcher, _ = h.start(h.config(tmp_path, tokens_file=tokens_file(tmp_path)))
    clients = {
        who: Client(launcher.address, token=f"{who}-token") for who in ("alice", "bob", "root")
    }
    yield launcher, clients
    for c in clients.values():
        c.close()
    launcher.stop()


def code_of(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_unauthenticated_calls_are_rejected(secured):
    launcher, _ = secured
    for token in (None, "wrong-token"):
        anonymous = Client(launcher.address, token=token)
        for call in (
            lambda c=anonymous: c.submit(h.spec()),
            lambda c=anonymous: c.list(),
            lambda c=anonymous: c.get("j1"),
            lambda c=anonymous: list(c.watch("j1")),
        ):
            assert code_of(call) == grpc.StatusCode.UNAUTHENTICATED
        assert health.check(anonymous.channel) == health.SERVING  # probes need no token
        anonymous.close()


def test_teams_see_and_cancel_only_their_own_jobs(secured, tmp_path):
    _, c = secured
    h.behave(tmp_path, "long", steps=10_000, step_seconds=0.02)
    mine = c["alice"].submit(h.spec("long"))
    assert (mine.spec.owner, mine.spec.team) == ("alice", "nlp")  # filled from the token
    theirs = c["bob"].submit(h.spec("other"))
    assert [j.id for j in c["alice"].list().jobs] == [mine.id]
    assert [j.id for j in c["bob"].list().jobs] == [theirs.id]
    assert {j.id for j in c["root"].list().jobs} == {mine.id, theirs.id}
    assert code_of(lambda: c["alice"].get(theirs.id)) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: c["alice"].cancel(theirs.id)) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: list(c["alice"].logs(theirs.id))) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: c["alice"].list(team="vision")) == grpc.StatusCode.PERMISSION_DENIED
    spoof = h.spec("spoof", team="vision")
    assert code_of(lambda: c["alice"].submit(spoof)) == grpc.StatusCode.PERMISSION_DENIED
    on_behalf = c["root"].submit(h.spec("for-bob", team="vision", owner="bob"))
    assert (on_behalf.spec.owner, on_behalf.spec.team) == ("bob", "vision")
    assert c["root"].cancel(mine.id).stop == job_pb2.STOP_CANCEL
    assert h.wait_for(c["alice"], mine.id, h.FINAL).state == job_pb2.CANCELLED


def test_trainers_report_with_their_attempt_token_only(secured, tmp_path):
    launcher, c = secured
    h.behave(tmp_path, "long", steps=10_000, step_seconds=0.02)
    job = c["alice"].submit(h.spec("long"))
    h.wait_for_step(c["alice"], job.id, 3)  # the fake trainer read its token file
    forged = progress_pb2.Progress(job_id=job.id, attempt=1, step=10**6)
    for token in (None, "alice-token", "guess"):
        md = [("authorization", f"Bearer {token}")] if token else None
        call = lambda md=md: c["alice"].stub.ReportProgress(iter([forged]), metadata=md)  # noqa: E731
        assert code_of(call) == grpc.StatusCode.UNAUTHENTICATED
    assert c["alice"].get(job.id).progress.step < 10**6
    c["alice"].cancel(job.id)
    h.wait_for(c["alice"], job.id, h.FINAL)


def make_certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1 and localhost, made with the openssl CLI."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


def test_tls_with_auth_end_to_end(tmp_path):
    cert, key = make_certificate(tmp_path)
    cfg = h.config(tmp_path, tokens_file=tokens_file(tmp_path), tls_cert=cert, tls_key=key)
    launcher, _ = h.start(cfg)
    secure = Client(launcher.address, token="alice-token", tls_ca=cert)
    plain = Client(launcher.address, token="alice-token")
    try:
        job = secure.submit(h.spec("tls", steps=4))
        done = h.wait_for(secure, job.id, h.FINAL)
        assert done.state == job_pb2.SUCCEEDED
        assert done.progress.step == 4  # the trainer reported over TLS (KITCHEN_LAUNCHER_TLS_CA)
        assert code_of(lambda: plain.list(timeout=3)) == grpc.StatusCode.UNAVAILABLE
    finally:
        secure.close()
        plain.close()
        launcher.stop()
