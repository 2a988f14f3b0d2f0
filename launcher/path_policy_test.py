"""The path policy, by state: a config, a spec and the teams of stored jobs in, a verdict out."""

import os

import pytest

from launcher import path_policy
from protos import job_pb2, launcher_pb2
from protos.config_yaml import ConfigError

TEAMS = {"j000001": "vision", "j000002": "speech"}


@pytest.fixture
def tree(tmp_path):
    for d in ("state/precook", "state/runs/j000001", "state/runs/j000002", "data/vision", "etc"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "state" / "state.db").write_text("")
    (tmp_path / "etc" / "shadow").write_text("secret")
    os.symlink(tmp_path / "etc" / "shadow", tmp_path / "data" / "vision" / "link")
    return tmp_path


def config(tree, roots=(), auth=False):
    cfg = launcher_pb2.LauncherConfig(state_dir=str(tree / "state"))
    cfg.paths.allowed_roots.extend(roots)
    if auth:
        cfg.tokens_file = str(tree / "tokens.yaml")
    return cfg


def spec(team="vision", **paths):
    s = job_pb2.JobSpec(name="j", kind=job_pb2.EVAL, team=team, owner="ada")
    for key, value in paths.items():
        section, name = key.split("__")
        setattr(getattr(s.trainer, section), name, str(value))
    return s


def refused(s, cfg) -> str:
    with pytest.raises(ConfigError) as err:
        path_policy.check(s, cfg, TEAMS.get)
    return str(err.value)


def test_single_user_launcher_allows_any_path_outside_its_state(tree):
    path_policy.check(spec(data__input=tree / "etc"), config(tree), TEAMS.get)


def test_a_shared_launcher_allows_only_its_roots(tree):
    cfg = config(tree, roots=[str(tree / "data" / "{team}")], auth=True)
    path_policy.check(spec(data__input=tree / "data" / "vision"), cfg, TEAMS.get)
    message = refused(spec(data__input=tree / "etc" / "shadow"), cfg)
    assert message.startswith("trainer.data.input: ") and "outside the directories" in message
    assert "outside" in refused(spec(team="speech", data__input=tree / "data" / "vision"), cfg)


def test_a_symlink_out_of_an_allowed_root_is_refused(tree):
    cfg = config(tree, roots=[str(tree / "data" / "{team}")], auth=True)
    link = tree / "data" / "vision" / "link"
    assert f"(-> {tree / 'etc' / 'shadow'})" in refused(spec(data__tokenizer_path=link), cfg)


def test_auth_without_roots_allows_nothing_outside_the_state_dir(tree):
    message = refused(spec(data__input=tree / "data"), config(tree, auth=True))
    assert "none configured (paths.allowed_roots)" in message


def test_state_dir_shares_the_cache_and_the_teams_own_runs_only(tree):
    cfg = config(tree)
    state = tree / "state"
    path_policy.check(spec(data__cache_dir=state / "precook" / "vision"), cfg, TEAMS.get)
    shared = refused(spec(data__input=state / "precook"), cfg)  # every team's datasets
    assert shared.startswith("trainer.data.input: ") and "per team" in shared
    assert "per team" in refused(spec(data__input=state / "precook" / "speech" / "ds"), cfg)
    path_policy.check(spec(checkpoint__path=state / "runs" / "j000001" / "ck"), cfg, TEAMS.get)
    other = refused(spec(checkpoint__path=state / "runs" / "j000002"), cfg)
    assert other.startswith("trainer.checkpoint.path: ") and "team 'speech'" in other
    assert "launcher's own state" in refused(spec(data__input=state / "state.db"), cfg)
    assert "no job 'j000009'" in refused(spec(data__cache_dir=state / "runs" / "j000009"), cfg)


def test_relative_paths_are_refused(tree):
    assert "is relative" in refused(spec(data__input="data/x"), config(tree))


def test_every_mixture_source_input_is_checked_like_data_input(tree):
    cfg = config(tree, roots=[str(tree / "data" / "{team}")], auth=True)
    s = spec()
    s.trainer.data.sources.add(name="ok", input=str(tree / "data" / "vision"))
    s.trainer.data.sources.add(name="bad", input=str(tree / "etc" / "shadow"))
    message = refused(s, cfg)
    assert message.startswith("trainer.data.sources[1].input: ") and "outside" in message
    s.trainer.data.sources[1].input = "etc"
    assert "is relative" in refused(s, cfg)


def test_an_image_layout_is_a_path_like_any_other(tree):
    cfg = config(tree, roots=[str(tree / "data" / "{team}")], auth=True)
    mine = spec()
    mine.image = str(tree / "data" / "vision" / "img.oci")
    path_policy.check(mine, cfg, TEAMS.get)
    theirs = spec(team="speech")
    theirs.image = mine.image  # another team's layout
    assert refused(theirs, cfg).startswith("image: ")
    theirs.image = "registry.example/x@sha256:" + "0" * 64  # a registry reference: not a path
    path_policy.check(theirs, cfg, TEAMS.get)
