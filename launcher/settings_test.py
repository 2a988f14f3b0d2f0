"""The launcher's config resolved: what it would expose beyond this machine is refused unless
it is protected or explicitly allowed."""

import pytest

from launcher import settings
from protos import launcher_pb2
from protos.config_yaml import ConfigError


def resolve(tmp_path, **fields) -> launcher_pb2.LauncherConfig:
    cfg = launcher_pb2.LauncherConfig(state_dir=str(tmp_path / "state"), **fields)
    return settings.resolve(cfg)


def refused(tmp_path, **fields) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(tmp_path, **fields)
    return str(err.value)


@pytest.mark.parametrize(
    "address, loopback",
    [("127.0.0.1:1", True), ("127.8.0.1:1", True), ("[::1]:1", True), ("localhost:1", True),
     ("0.0.0.0:1", False), ("[::]:1", False), (":1", False), ("10.0.0.5:1", False),
     ("launcher.ml:1", False)],
)  # fmt: skip
def test_loopback_addresses(address, loopback):
    assert settings.is_loopback(address) is loopback


def test_the_defaults_serve_this_machine_only_with_job_names(tmp_path):
    cfg = resolve(tmp_path)
    assert settings.is_loopback(cfg.listen) and settings.is_loopback(cfg.metrics_listen)
    assert cfg.exposure.metrics_job_names


def test_off_loopback_needs_tls_and_tokens_or_an_explicit_yes(tmp_path):
    message = refused(tmp_path, listen="0.0.0.0:50051")
    assert message.startswith("listen: 0.0.0.0:50051 is reachable") and "tls_cert" in message
    plaintext = launcher_pb2.Exposure(allow_plaintext=True)
    message = refused(tmp_path, listen="0.0.0.0:50051", exposure=plaintext)
    assert "without tokens_file anyone there can submit" in message
    trusted = launcher_pb2.Exposure(allow_plaintext=True, allow_unauthenticated=True)
    assert resolve(tmp_path, listen="0.0.0.0:50051", exposure=trusted).listen == "0.0.0.0:50051"


def test_metrics_off_loopback_with_auth_need_their_own_token(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens: []\n")
    message = refused(tmp_path, tokens_file=str(tokens), metrics_listen="0.0.0.0:9464")
    assert message.startswith("metrics_listen: ") and "metrics_token_file" in message
    short = tmp_path / "short"
    short.write_text("abc\n")
    exposure = launcher_pb2.Exposure(metrics_token_file=str(short))
    message = refused(tmp_path, tokens_file=str(tokens), metrics_listen=":9464", exposure=exposure)
    assert "exposure.metrics_token_file: holds fewer than 16" in message
    good = tmp_path / "metrics-token"
    good.write_text("0123456789abcdef-metrics\n")
    exposure.metrics_token_file = str(good)
    cfg = resolve(tmp_path, tokens_file=str(tokens), metrics_listen=":9464", exposure=exposure)
    assert not cfg.exposure.metrics_job_names  # a shared launcher shows ids, not names


def test_the_postgres_connection_string_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    secret = "host=db.example dbname=kitchen user=k password=hunter2-secret"
    store = launcher_pb2.StoreConfig
    assert not resolve(tmp_path).store.HasField("postgres")  # the default: SQLite
    neither = refused(tmp_path, store=store(postgres=launcher_pb2.PostgresStore()))
    assert neither.startswith("store.postgres: set one of dsn_file and dsn_env")
    both = launcher_pb2.PostgresStore(dsn_file="f", dsn_env="E")
    assert refused(tmp_path, store=store(postgres=both)).startswith("store.postgres: set one")

    by_env = store(postgres=launcher_pb2.PostgresStore(dsn_env="KITCHEN_TEST_DSN"))
    monkeypatch.delenv("KITCHEN_TEST_DSN", raising=False)
    assert refused(tmp_path, store=by_env) == (
        "store.postgres.dsn_env: the environment variable KITCHEN_TEST_DSN is not set or empty"
    )
    monkeypatch.setenv("KITCHEN_TEST_DSN", secret)
    assert settings.store_dsn(resolve(tmp_path, store=by_env)) == secret

    path = tmp_path / "dsn"
    path.write_text(secret + "\n")
    path.chmod(0o644)
    by_file = store(postgres=launcher_pb2.PostgresStore(dsn_file=str(path)))
    message = refused(tmp_path, store=by_file)
    assert message.startswith(f"store.postgres.dsn_file: {path} may be read by group or others")
    path.chmod(0o600)
    assert settings.store_dsn(resolve(tmp_path, store=by_file)) == secret
    path.write_text("")
    assert refused(tmp_path, store=by_file) == f"store.postgres.dsn_file: {path} is empty"
    assert "hunter2" not in message + neither


def test_replica_addresses_are_host_port_and_only_for_replicas(tmp_path, monkeypatch):
    monkeypatch.setenv("KITCHEN_TEST_DSN", "postgresql:///kitchen")

    def pg(**fields):
        pg = launcher_pb2.PostgresStore(dsn_env="KITCHEN_TEST_DSN", **fields)
        return launcher_pb2.StoreConfig(postgres=pg)

    both = ["127.0.0.1:50061", "127.0.0.1:50062"]
    assert refused(tmp_path, store=pg(replica_addresses=both)).startswith(
        "store.postgres.replica_addresses: only with replicas: true"
    )
    bad = pg(replicas=True, replica_addresses=["127.0.0.1:50061", "127.0.0.1"])
    assert refused(tmp_path, store=bad) == (
        "store.postgres.replica_addresses[1]: '127.0.0.1' is not HOST:PORT"
    )
    resolved = resolve(tmp_path, store=pg(replicas=True, replica_addresses=both))
    assert list(resolved.store.postgres.replica_addresses) == both
