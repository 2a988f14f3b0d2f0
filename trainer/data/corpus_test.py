import json
import os

import pytest

from protos.defaults import data_with_defaults
from trainer.data import corpus, testdata
from trainer.data.errors import CorpusError, DataConfigError


def cfg(**fields):
    return data_with_defaults(testdata.data_config(**fields))


def records(plan, c):
    return [r for unit in plan.units for r in corpus.read_unit(unit, c, plan.fmt)]


def test_directory_of_text_files_in_path_order_with_content_hashes(tmp_path):
    texts = testdata.write_text_corpus(str(tmp_path / "c"), n=12)
    os.makedirs(tmp_path / "c" / ".hidden")
    (tmp_path / "c" / ".hidden" / "x.txt").write_text("not read")
    (tmp_path / "c" / ".dotfile").write_text("not read")
    c = cfg(input=str(tmp_path / "c"))
    plan = corpus.plan_corpus(c, "TEXT_FILES")
    assert plan.records == 12
    assert [f.relpath for f in plan.files] == [f"doc-{i:03d}.txt" for i in range(12)]
    assert [r.text for r in records(plan, c)] == texts
    again = corpus.plan_corpus(c, "TEXT_FILES")
    assert corpus.input_hashes(again) == corpus.input_hashes(plan)


def test_glob_and_max_documents(tmp_path):
    testdata.write_text_corpus(str(tmp_path), n=10)
    c = cfg(input=str(tmp_path / "doc-00*.txt"), max_documents=4)
    plan = corpus.plan_corpus(c, "TEXT_FILES")
    assert plan.records == 4 and len(plan.files) == 4
    assert plan.root == str(tmp_path)


def test_jsonl_units_keep_line_numbers_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "UNIT_BYTES", 64)  # many units from one small file
    lines = []
    for i in range(40):
        lines.append(json.dumps({"text": f"document {i} {'x' * (i % 7)}"}))
        if i % 5 == 0:
            lines.append("   ")  # blank lines are not records
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines))  # no newline at the end
    c = cfg(input=str(path))
    plan = corpus.plan_corpus(c, "JSONL")
    assert len(plan.units) > 5
    got = records(plan, c)
    assert [r.index for r in got] == list(range(40))
    assert [r.text.split()[1] for r in got] == [str(i) for i in range(40)]
    line_of = {i: n + 1 for n, ln in enumerate(lines) if ln.strip() for i in [int(ln.split()[2])]}
    assert [int(r.source.rsplit(":", 1)[1]) for r in got] == [line_of[i] for i in range(40)]


def test_jsonl_max_documents_stops_mid_file(tmp_path):
    testdata.write_jsonl(str(tmp_path / "a.jsonl"), [{"text": f"t{i}"} for i in range(10)])
    c = cfg(input=str(tmp_path / "a.jsonl"), max_documents=3)
    plan = corpus.plan_corpus(c, "JSONL")
    assert [r.text for r in records(plan, c)] == ["t0", "t1", "t2"]


def test_chat_records(tmp_path):
    rows = testdata.write_chat_corpus(str(tmp_path / "chat.jsonl"), n=5)
    c = cfg(input=str(tmp_path / "chat.jsonl"))
    plan = corpus.plan_corpus(c, "JSONL_CHAT")
    got = records(plan, c)
    assert [(r.prompt, r.response) for r in got] == [(x["prompt"], x["response"]) for x in rows]


def test_stdlib_default_is_python_files_without_site_packages():
    description, root, files, is_stdlib = corpus.resolve_input("", "TEXT_FILES")
    assert is_stdlib and "standard library" in description
    assert files and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in os.path.relpath(f, root).split(os.sep) for f in files)
    assert os.path.join(root, "json", "decoder.py") in files


def test_unreadable_file_names_the_file(tmp_path):
    testdata.write_text_corpus(str(tmp_path), n=3)
    os.symlink(tmp_path / "missing-target.txt", tmp_path / "doc-001b.txt")
    with pytest.raises(CorpusError, match=r"doc-001b\.txt: cannot read: No such file"):
        corpus.plan_corpus(cfg(input=str(tmp_path)), "TEXT_FILES")


def test_invalid_utf8_names_file_and_line(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"fine\nstill fine\nbad \xff byte\n")
    c = cfg(input=str(tmp_path))
    plan = corpus.plan_corpus(c, "TEXT_FILES")
    with pytest.raises(CorpusError, match=r"bad\.txt:3: invalid UTF-8 \(byte 0xff\)"):
        records(plan, c)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"body": "x"}', r"d\.jsonl:2: no field 'text' \(fields here: 'body'\)"),
        ('{"text": 3}', r"d\.jsonl:2: field 'text' is a int, expected a string"),
        ("{not json", r"d\.jsonl:2: invalid JSON"),
        ("[1, 2]", r"d\.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, message):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n' + line + "\n")
    c = cfg(input=str(tmp_path / "d.jsonl"))
    plan = corpus.plan_corpus(c, "JSONL")
    with pytest.raises(CorpusError, match=message):
        records(plan, c)


def test_empty_corpus_and_missing_input(tmp_path):
    with pytest.raises(DataConfigError, match="data.input: .* does not exist"):
        corpus.plan_corpus(cfg(input=str(tmp_path / "nope")), "TEXT_FILES")
    with pytest.raises(DataConfigError, match="data.input: .*matches no files"):
        corpus.plan_corpus(cfg(input=str(tmp_path / "*.txt")), "TEXT_FILES")
    with pytest.raises(DataConfigError, match="holds no files"):
        corpus.plan_corpus(cfg(input=str(tmp_path)), "TEXT_FILES")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(CorpusError, match="the corpus is empty"):
        corpus.plan_corpus(cfg(input=str(tmp_path / "blank.jsonl")), "JSONL")
