"""Layer tarballs are byte-for-byte reproducible and carry no host-specific metadata."""

import gzip
import hashlib
import os
import tarfile

import pytest

from tools.oci import layer_tar


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "main.py").write_text("print('hi')\n")
    (root / "pkg" / "sub" / "data.bin").write_bytes(os.urandom(4096))
    (root / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "pkg" / "run.sh", 0o700)
    os.symlink("main.py", root / "pkg" / "alias.py")
    return root


def test_same_files_give_same_bytes_regardless_of_times_and_order(tree, tmp_path):
    entries = layer_tar.tree_entries(str(tree), "/opt/app")
    first = layer_tar.write_layer(entries, str(tmp_path / "a.tar.gz"))
    for path in tree.rglob("*"):
        os.utime(path, (123456789, 123456789), follow_symlinks=False)
    second = layer_tar.write_layer(list(reversed(entries)), str(tmp_path / "b.tar.gz"))
    assert first == second
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()


def test_digests_describe_the_blob_and_the_uncompressed_tar(tree, tmp_path):
    blob = tmp_path / "layer.tar.gz"
    desc = layer_tar.write_layer(layer_tar.tree_entries(str(tree), "/opt/app"), str(blob))
    data = blob.read_bytes()
    assert desc["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert desc["size"] == len(data)
    assert desc["diff_id"] == "sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest()
    assert desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"


def test_headers_are_normalized(tree, tmp_path):
    blob = tmp_path / "layer.tar.gz"
    layer_tar.write_layer(layer_tar.tree_entries(str(tree), "/opt/app"), str(blob))
    header = blob.read_bytes()[:10]
    assert header[3] == 0, "gzip FLG: no file name or comment"
    assert header[4:8] == b"\0\0\0\0", "gzip MTIME must be 0"
    with tarfile.open(blob) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    # Parents come first and are explicit, so unpacking never invents permissions.
    assert names[:4] == ["opt", "opt/app", "opt/app/pkg", "opt/app/pkg/__init__.py"]
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
    by_name = {m.name: m for m in members}
    assert by_name["opt/app/pkg/run.sh"].mode == 0o755
    assert by_name["opt/app/pkg/main.py"].mode == 0o644
    assert by_name["opt/app/pkg/sub"].isdir() and by_name["opt/app/pkg/sub"].mode == 0o755
    assert by_name["opt/app/pkg/alias.py"].issym()
    assert by_name["opt/app/pkg/alias.py"].linkname == "main.py"


def test_a_one_line_change_changes_the_digest(tree, tmp_path):
    before = layer_tar.write_layer(layer_tar.tree_entries(str(tree), "/a"), str(tmp_path / "1"))
    with open(tree / "pkg" / "main.py", "a") as f:
        f.write("print('one more line')\n")
    after = layer_tar.write_layer(layer_tar.tree_entries(str(tree), "/a"), str(tmp_path / "2"))
    assert before["digest"] != after["digest"]
    assert before["diff_id"] != after["diff_id"]


def test_two_sources_for_one_path_is_an_error_naming_both(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("a")
    b.write_text("b")
    entries = [
        layer_tar.Entry("/app/x.py", source=str(a)),
        layer_tar.Entry("/app/x.py", source=str(b)),
    ]
    with pytest.raises(ValueError, match=r"/app/x.py comes from two places: .*a.py and .*b.py"):
        layer_tar.write_layer(entries, str(tmp_path / "out.tar.gz"))


def test_relative_paths_and_the_root_are_refused(tmp_path):
    src = tmp_path / "f"
    src.write_text("x")
    for bad in ("/", "opt/app/x.py"):
        with pytest.raises(ValueError, match="absolute path inside the image"):
            layer_tar.write_layer([layer_tar.Entry(bad, source=str(src))], str(tmp_path / "o"))


def test_tree_entries_can_select_files(tree):
    entries = layer_tar.tree_entries(str(tree), "/x", only={"pkg/main.py", "pkg/alias.py"})
    assert sorted(e.path for e in entries) == ["/x/pkg/alias.py", "/x/pkg/main.py"]


def test_gzip_tar_keeps_the_tar_and_pins_the_header(tree, tmp_path):
    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w") as tar:
        tar.add(tree, arcname=".")
    desc = layer_tar.gzip_tar(str(plain), str(tmp_path / "a.gz"))
    again = layer_tar.gzip_tar(str(plain), str(tmp_path / "b.gz"))
    assert desc == again
    assert gzip.decompress((tmp_path / "a.gz").read_bytes()) == plain.read_bytes()
    assert desc["diff_id"] == "sha256:" + hashlib.sha256(plain.read_bytes()).hexdigest()
