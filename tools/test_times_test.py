"""test_times.py on a build event log written as Bazel 4 writes one (the events' shape copied
from a real `--build_event_json_file`)."""

import json

import pytest

from tools import test_times


def events(path, tests: dict[str, tuple[str, list[int]]]):
    """A log with, per label, its size and one testResult per attempt (milliseconds)."""
    lines = [{"id": {"started": {}}, "started": {"command": "test"}}]
    for label, (size, attempts) in tests.items():
        lines.append(
            {
                "id": {"targetConfigured": {"label": label}},
                "configured": {"targetKind": "py_test rule", "testSize": size},
            }
        )
        for n, ms in enumerate(attempts, 1):
            ident = {"label": label, "run": 1, "shard": 1, "attempt": n}
            result = {"testAttemptDurationMillis": str(ms), "status": "PASSED"}
            lines.append({"id": {"testResult": ident}, "testResult": result})
    path.write_text("\n".join(json.dumps(e) for e in lines) + "\n")
    return path


def test_a_test_without_the_margin_is_named_with_the_size_it_needs(tmp_path, capsys):
    log = events(
        tmp_path / "bep.json",
        {
            "//kernels:reference_test": ("SMALL", [21_900]),  # 60 s < 3 x 21.9 s
            "//protos:protos_test": ("SMALL", [1_000]),
            "//trainer/parallel:eval_test": ("MEDIUM", [59_000, 103_000]),  # the longer: 103 s
        },
    )
    assert test_times.main([str(log)]) == 1
    out, err = capsys.readouterr()
    rows = [r for r in out.splitlines() if r.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [  # slowest first
        "//trainer/parallel:eval_test",
        "//kernels:reference_test",
        "//protos:protos_test",
    ]
    assert "| 103.0 | 2.9 **< 3: large** |" in rows[0]
    assert err.splitlines() == [
        '//trainer/parallel:eval_test: 103.0 s measured, medium gives 300 s: size = "large"',
        '//kernels:reference_test: 21.9 s measured, small gives 60 s: size = "medium"',
    ]
    assert test_times.main([str(log), "--margin", "2.5"]) == 0
    with pytest.raises(SystemExit):
        test_times.main([str(log), "--margin", "0"])
    assert "--margin: 0 must be positive" in capsys.readouterr().err


def test_a_file_that_is_not_a_build_event_log_is_named_with_its_line(tmp_path):
    log = tmp_path / "bep.json"
    log.write_text('{"id": {}}\nnot json\n')
    with pytest.raises(SystemExit, match="bep.json:2: not a build event"):
        test_times.main([str(log)])
