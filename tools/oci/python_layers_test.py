"""python_layers.py's pure parts: lock parsing, dependency closures, and what a layer ships.

The pip installs themselves run in the repository rule and are checked through the built
images (//images:image_contents_test, //images:run_images_test).
"""

import importlib.metadata
import os

import pytest

from tools.oci import python_layers


def fake_dist(site, name: str, version: str, requires: list[str], files: dict[str, str]):
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
    lines += [f"Requires-Dist: {r}\n" for r in requires]
    (info / "METADATA").write_text("".join(lines))
    record = []
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        record.append(f"{rel},sha256=x,{len(text)}\n")
    record.append(f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    (info / "RECORD").write_text("".join(record))
    return importlib.metadata.PathDistribution(info)


def test_lock_is_normalized_and_must_be_pinned(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("# header\nPyYAML==6.0.4\ntyping_extensions==4.16.0  # why\n")
    assert python_layers.read_lock(str(lock)) == {
        "pyyaml": "PyYAML==6.0.4",
        "typing-extensions": "typing_extensions==4.16.0",
    }
    lock.write_text("numpy>=2\n")
    with pytest.raises(SystemExit, match=r"requirements.lock:1: 'numpy>=2' is not pinned"):
        python_layers.read_lock(str(lock))


def test_closure_follows_requirements_and_skips_unmet_markers(tmp_path):
    site = tmp_path / "site"
    installed = {
        "app": (
            str(site),
            fake_dist(site, "app", "1", ["Lib_A>=1", 'old; python_version < "3"'], {}),
        ),
        "lib-a": (
            str(site),
            fake_dist(site, "Lib_A", "1", ['extra-only; extra == "docs"', "lib-b"], {}),
        ),
        "lib-b": (str(site), fake_dist(site, "lib.b", "1", [], {})),
    }
    assert python_layers.closure(["app"], installed) == {"app", "lib-a", "lib-b"}


def test_layers_leave_out_console_scripts_and_their_record_lines(tmp_path):
    site = tmp_path / "target" / "lib" / "site"  # pip's ../../bin/ lands in tmp_path/target
    files = {"tool/__init__.py": "x = 1\n", "../../bin/tool": "#!/some/venv/bin/python3\n"}
    dist = fake_dist(site, "tool", "1", [], files)
    entries = python_layers.dist_entries(str(site), dist, "/opt/site", str(tmp_path / "scratch"))
    paths = {e.path: e.source for e in entries}
    assert "/opt/site/tool/__init__.py" in paths
    assert not any("bin" in p for p in paths)
    record = paths["/opt/site/tool-1.dist-info/RECORD"]
    assert record is not None, "RECORD is a file, not a directory or link"
    assert record.startswith(str(tmp_path / "scratch")), "a trimmed copy, not pip's file"
    text = open(record).read()
    assert "tool/__init__.py" in text and "bin/tool" not in text
    assert os.path.exists(site / "tool-1.dist-info" / "RECORD"), "pip's RECORD is left alone"
