"""A task directory is another team's input: its YAMLs run no code unless the launcher allows it.

Each attack writes a marker file if its code runs; the refused ones must leave none, and the
allowed one (allow_task_code) must write it, so the tests can tell code that ran from code that
did not."""

import pytest

from protos.config_yaml import ConfigError
from trainer.interop import harness

TASK = "task: evil\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: d.jsonl\n"


def evil_module(where, marker):
    (where / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\ndef process(docs):\n    return docs\n"
    )


def test_function_tags_are_refused_naming_the_file_and_line(tmp_path):
    marker = tmp_path / "ran"
    evil_module(tmp_path, marker)
    (tmp_path / "evil.yaml").write_text(TASK + "process_docs: !function evil.process\n")
    with pytest.raises(ConfigError, match=r"evil.yaml:6: `!function evil.process` runs code"):
        harness.task_specs(["evil"], str(tmp_path))
    assert not marker.exists()
    (spec,) = harness.task_specs(["evil"], str(tmp_path), allow_code=True)  # a trusted team
    assert isinstance(spec, dict)
    assert marker.read_text() == "ran" and callable(spec["process_docs"])


@pytest.mark.parametrize("include", ["ABS", "../elsewhere/evil.yaml"])
def test_includes_from_outside_the_task_directory_are_refused(tmp_path, include):
    elsewhere, tasks = tmp_path / "elsewhere", tmp_path / "tasks"
    elsewhere.mkdir()
    tasks.mkdir()
    marker = tmp_path / "ran"
    evil_module(elsewhere, marker)
    (elsewhere / "evil.yaml").write_text("process_docs: !function evil.process\n")
    target = str(elsewhere / "evil.yaml") if include == "ABS" else include
    (tasks / "evil.yaml").write_text(f"include: {target}\n" + TASK)
    with pytest.raises(ConfigError, match="include .*: name a file beside it"):
        harness.task_specs(["evil"], str(tasks))
    assert not marker.exists()


def test_an_include_beside_the_file_is_read_as_data_too(tmp_path):
    marker = tmp_path / "ran"
    evil_module(tmp_path, marker)
    (tmp_path / "base.inc").write_text("process_docs: !function evil.process\n")
    (tmp_path / "evil.yaml").write_text("include: base.inc\n" + TASK)
    with pytest.raises(ConfigError, match=r"base.inc:1: `!function"):
        harness.task_specs(["evil"], str(tmp_path))
    assert not marker.exists()


def test_the_harness_own_task_files_still_load(tmp_path):
    """arc_easy.yaml from the harness (trusted: its `!function`s are the harness's code)."""
    (tmp_path / "mine.yaml").write_text("include: arc/arc_easy.yaml\n" + TASK.replace("evil", "m"))
    (spec,) = harness.task_specs(["m"], str(tmp_path))
    assert isinstance(spec, dict) and spec["task"] == "m" and "doc_to_text" in spec


def test_prompt_templates_cannot_reach_python(tmp_path):
    """Jinja in a task's doc_to_text is rendered in Jinja's sandbox: no attribute walk to os."""
    from jinja2 import Environment
    from jinja2.exceptions import SecurityError
    from lm_eval import utils

    def payload(marker):
        return "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"

    control = tmp_path / "control"
    Environment().from_string(payload(control)).render()  # the harness's kind of environment
    assert control.exists()  # so the payload is real
    marker = tmp_path / "ran"
    harness.sandbox_templates()
    assert utils.apply_template("Q: {{question}}", {"question": "why"}) == "Q: why"
    with pytest.raises(SecurityError):
        utils.apply_template(payload(marker), {})
    assert not marker.exists()
