"""EXPORT: a trained checkpoint loads in transformers (no custom code) and predicts the same."""

import json
from typing import Any

import pytest
import torch

from protos.files import sha256_file
from trainer import checkpoint, main
from trainer.data.testdata import write_chat_corpus
from trainer.data.tokenizer import load_tokenizer
from trainer.generate import generate
from trainer.interop.publish import CHECKSUMS
from trainer.testing import tiny_job, write_job

torch.set_num_threads(1)
# fp32 on CPU: the two implementations differ only in the order of floating-point operations
# (fused vs separate projections, SDPA kernels). Measured on the guides' SFT model
# (docs/interop.md): max |diff| 4.3e-6 over 128 tokens, logits up to 9.0.
LOGITS_ATOL = 1e-4
TEXT = "def parse(self, message):\n    return self._parser.parse(message)\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A pretrained and an SFT checkpoint of the tiny model, each exported."""
    tmp = tmp_path_factory.mktemp("export")
    cache = tmp / "cache"
    pretrain = write_job(tmp / "pretrain.yaml", tiny_job(cache, steps=4))
    assert main.main(["--config", str(pretrain), "--run-dir", str(tmp / "pre")]) == 0
    (dataset,) = (cache / "datasets").iterdir()
    step4 = tmp / "pre" / "checkpoints" / "step_00000004"
    write_chat_corpus(str(tmp / "chat.jsonl"), n=40)
    spec = tiny_job(cache, kind="SFT", steps=2, optim={"lr": 3e-4})
    spec["trainer"]["data"].update(
        input=str(tmp / "chat.jsonl"),
        format="jsonl_chat",
        tokenizer="bpe_file",
        tokenizer_path=str(dataset / "tokenizer.json"),
    )
    spec["trainer"]["checkpoint"] = {"path": str(step4), "every_steps": 2}
    assert (
        main.main(
            ["--config", str(write_job(tmp / "sft.yaml", spec)), "--run-dir", str(tmp / "sft")]
        )
        == 0
    )
    out = {}
    for name, source in (("pre", step4), ("sft", tmp / "sft/checkpoints/step_00000002")):
        job: dict[str, Any] = {"name": f"export-{name}", "kind": "EXPORT"}
        job["trainer"] = {
            "checkpoint": {"path": str(source)},
            "hf": {"path": str(tmp / f"hf-{name}")},
        }
        assert main.main(["--config", str(write_job(tmp / f"export-{name}.yaml", job))]) == 0
        out[name] = (source, tmp / f"hf-{name}")
    return tmp, dataset, out


def test_transformers_loads_it_and_gives_the_same_logits_and_greedy_text(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, dataset, out = runs
    source, hf_dir = out["pre"]
    ours, meta = checkpoint.load_model(source, torch.device("cpu"), use_kernels=False)
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    tok = load_tokenizer(str(dataset))
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = hf_tok(TEXT).input_ids
    assert ids == [tok.bos_id] + tok.encode(TEXT)  # BOS first, as every Kitchen document
    x = torch.tensor([ids])
    with torch.no_grad():
        kitchen_logits = ours(x, torch.arange(len(ids))[None])
        hf_logits = theirs(x).logits
    assert (kitchen_logits - hf_logits).abs().max() < LOGITS_ATOL
    new, _ = generate(
        ours, ids, 24, temperature=0, stop_id=tok.eos_id, max_len=meta.model.max_seq_len
    )
    hf_new = theirs.generate(x, max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert hf_new == new
    assert hf_tok.decode(hf_new, skip_special_tokens=True) == tok.decode(new)


def test_an_sft_checkpoint_carries_its_chat_template(runs):
    from transformers import AutoTokenizer

    _, dataset, out = runs
    tok = load_tokenizer(str(dataset))
    hf_tok = AutoTokenizer.from_pretrained(out["sft"][1])
    prompt = "What is 3 plus 3?"
    chat = [{"role": "user", "content": prompt}]
    ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert list(ids) == [tok.bos_id] + tok.encode(prompt)  # what SFT trained on, before the answer
    pretrained = json.loads((out["pre"][1] / "tokenizer_config.json").read_text())
    assert "chat_template" not in pretrained


def test_checksums_are_carried_and_checked(runs):
    tmp, _, out = runs
    source, hf_dir = out["pre"]
    sums = json.loads((hf_dir / CHECKSUMS).read_text())
    assert {p.name for p in hf_dir.iterdir()} == set(sums) | {CHECKSUMS}
    for name, digest in sums.items():
        assert sha256_file(str(hf_dir / name)) == digest["sha256"]
    provenance = json.loads((hf_dir / "kitchen_export.json").read_text())
    assert provenance["checkpoint_files"]["model.pt"]["sha256"] == sha256_file(
        str(source / "model.pt")
    )
    # A damaged export is refused on import, naming the file.
    damaged = tmp / "damaged"
    damaged.mkdir()
    for p in hf_dir.iterdir():
        (damaged / p.name).write_bytes(p.read_bytes())
    (damaged / "tokenizer.json").write_text("{}")
    job = {"name": "import-damaged", "kind": "IMPORT", "trainer": {"hf": {"path": str(damaged)}}}
    config = write_job(tmp / "import-damaged.yaml", job)
    assert main.main(["--config", str(config), "--run-dir", str(tmp / "imp")]) == 2


def test_export_then_import_gives_back_the_same_weights(runs):
    tmp, _, out = runs
    source, hf_dir = out["pre"]
    job = {"name": "import-back", "kind": "IMPORT", "trainer": {"hf": {"path": str(hf_dir)}}}
    config = write_job(tmp / "import-back.yaml", job)
    assert main.main(["--config", str(config), "--run-dir", str(tmp / "back")]) == 0
    back = torch.load(tmp / "back/checkpoints/step_00000000/model.pt")
    original = torch.load(source / "model.pt")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in back)


def test_export_refuses_to_overwrite_a_foreign_directory(runs, capsys):
    tmp, _, out = runs
    foreign = tmp / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    job: dict[str, Any] = {"name": "export-over", "kind": "EXPORT"}
    job["trainer"] = {"checkpoint": {"path": str(out["pre"][0])}, "hf": {"path": str(foreign)}}
    capsys.readouterr()
    assert main.main(["--config", str(write_job(tmp / "over.yaml", job))]) == 2
    assert "trainer.hf.path" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"
