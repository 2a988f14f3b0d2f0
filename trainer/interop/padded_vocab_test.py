"""A published-style checkpoint: a bf16 LlamaForCausalLM whose embedding has more rows (832)
than its tokenizer has ids (777), made here by transformers. It imports in bf16 with the same
logits, exports back to the same tensors in the same dtype, and SFT, eval, generate, the
engine and distillation (as the teacher) run on it; the padded ids are never sampled."""

import json
from typing import Any

import pytest
import torch

from trainer import checkpoint, main
from trainer.data.tokenizer import from_tokenizer_json, train_bpe
from trainer.inference import offline
from trainer.inference.engine import SamplingParams
from trainer.testing import stdlib_package, write_job

torch.set_num_threads(1)
TOKENS, ROWS = 777, 832  # ids of the tokenizer, rows of the model's embedding
LOGITS_ATOL = 1e-4
PROMPT = "import json\n"  # fp32 arithmetic on the same bf16 weights, in another order


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The HF directory, imported: (tmp, hf dir, the HF model, the imported checkpoint)."""
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("padded")
    hf = tmp / "hf"
    texts = (p.read_text() for p in sorted(Path(stdlib_package("json")).glob("*.py")))
    tok = train_bpe(texts, TOKENS)
    assert tok.vocab_size == TOKENS
    hf.mkdir()
    tok.save(str(hf))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=ROWS,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(hf)
    job = {"name": "import", "kind": "IMPORT", "trainer": {"hf": {"path": str(hf)}}}
    config_path = write_job(tmp / "import.yaml", job)
    assert main.main(["--config", str(config_path), "--run-dir", str(tmp / "import")]) == 0
    return tmp, hf, model, tmp / "import" / "checkpoints" / "step_00000000"


def data_section(tmp, **fields) -> dict[str, Any]:
    """Data precooked with the model's own 777-id tokenizer."""
    return {
        "input": stdlib_package("json"),
        "tokenizer": "bpe_file",
        "tokenizer_path": str(tmp / "hf" / "tokenizer.json"),
        "seq_len": 64,
        "eval_fraction": 0.2,
        "cache_dir": str(tmp / "cache"),
        "workers": 1,
        **fields,
    }


def job(tmp, name: str, kind: str, ckpt, **trainer: Any) -> int:
    """A job on `ckpt` with data_section (`trainer["data"]` adds to it; the other sections
    replace their defaults)."""
    data = data_section(tmp, **trainer.pop("data", {}))
    spec: dict[str, Any] = {"name": name, "kind": kind}
    spec["trainer"] = {"checkpoint": {"path": str(ckpt)}, "data": data, **trainer}
    config = write_job(tmp / f"{name}.yaml", spec)
    return main.main(["--config", str(config), "--run-dir", str(tmp / name)])


def test_import_keeps_the_rows_the_dtype_and_the_logits(run):
    _, _, theirs, path = run
    state = torch.load(path / "model.pt", weights_only=True)
    assert state["tok_embeddings.weight"].shape == (ROWS, 64)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}  # was fp32: twice the bytes
    ours, meta = checkpoint.load_model(path, torch.device("cpu"), use_kernels=False)
    assert meta.vocab_size == ROWS
    ids = torch.randint(0, TOKENS, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = ours(ids, torch.arange(40).expand(2, -1)) - theirs.float()(ids).logits
    assert diff.abs().max() < LOGITS_ATOL


def test_export_gives_back_the_same_tensors_in_bf16(run):
    from safetensors.torch import load_file

    tmp, hf, _, path = run
    out = tmp / "hf-export"
    assert job(tmp, "export", "EXPORT", path, hf={"path": str(out)}) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["dtype"]) == (ROWS, "bfloat16")
    theirs, ours = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    assert theirs.keys() == ours.keys()
    assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k]) for k in ours)
    size = (out / "model.safetensors").stat().st_size
    assert size < 1.01 * (hf / "model.safetensors").stat().st_size
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(out)) == TOKENS


def test_export_writes_another_dtype_when_asked(run):
    from safetensors.torch import load_file

    tmp, hf, _, path = run
    out = tmp / "hf-fp32"
    assert job(tmp, "export32", "EXPORT", path, hf={"path": str(out), "dtype": "fp32"}) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    theirs, ours = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(
        ours[k].dtype == torch.float32 and torch.equal(ours[k], theirs[k].float()) for k in ours
    )


def test_a_smaller_vocabulary_that_is_not_the_models_is_refused(run, capsys):
    tmp, _, _, path = run
    other = {"tokenizer": "bpe_train", "vocab_size": 600, "tokenizer_path": ""}
    capsys.readouterr()
    assert job(tmp, "other", "GENERATE", path, data=other, generate={"prompt": PROMPT}) == 2
    err = capsys.readouterr().err
    assert "trainer.data.tokenizer: the tokenizer has 600 ids, the model 832" in err
    assert "not the one it was imported with or trained on" in err


def test_eval_runs_on_the_padded_checkpoint(run):
    tmp, _, _, path = run
    harness = {"tasks": ["kitchen_stdlib_ppl"], "limit": 2}
    train = {"eval_batches": 2, "micro_batch": 4}
    assert job(tmp, "eval", "EVAL", path, eval=harness, train=train) == 0
    report = json.loads((tmp / "eval" / "eval.json").read_text())
    assert report["tokens"] > 0 and 0 < report["loss"] < 2 * torch.log(torch.tensor(ROWS))
    assert report["harness"]["kitchen_stdlib_ppl/bits_per_byte"] > 0


def test_sft_fine_tunes_the_padded_checkpoint(run):
    from google.protobuf import json_format

    from trainer.testing import chat_file

    tmp, _, _, path = run
    meta = checkpoint.verify(path, files=())
    model = json_format.MessageToDict(meta.model, preserving_proto_field_name=True)
    chat = chat_file(tmp / "chat.jsonl", n=40)
    assert (
        job(
            tmp,
            "sft",
            "SFT",
            path,
            model=model,
            train={"steps": 2, "micro_batch": 4, "log_every": 1, "eval_every": 0},
            checkpoint={"path": str(path), "every_steps": 2},
            data={"input": str(chat), "format": "jsonl_chat"},
        )
        == 0
    )
    tuned = checkpoint.verify(tmp / "sft" / "checkpoints" / "step_00000002", files=())
    assert tuned.vocab_size == ROWS


def test_a_padded_teacher_distills_into_a_student_of_the_tokenizers_size(run):
    tmp, _, _, path = run
    train = {"steps": 2, "micro_batch": 4, "log_every": 1, "eval_every": 0}
    distill = {"teacher_path": str(path)}
    assert job(tmp, "distill", "DISTILL", "", train=train, distill=distill) == 0
    student = checkpoint.verify(tmp / "distill" / "checkpoints" / "step_00000002", files=())
    assert student.vocab_size == TOKENS  # the data's ids: the teacher's padding is not copied


def engine_text(model, tok, params: SamplingParams, vocab) -> str:
    """What the engine samples after <bos> PROMPT, limited to `vocab` ids (None: every row)."""
    prompt = offline.Prompt([tok.bos_id] + tok.encode(PROMPT))
    (done,) = offline.generate(model, [prompt], params, eos_id=tok.eos_id, max_len=64, vocab=vocab)
    return tok.decode(done.token_ids)


def test_no_decode_path_samples_a_padded_id(run, capsys):
    """The engine cuts the padded rows off; the generate job and the serve job tell it to (a
    seeded draw equals the engine's with the cut, which differs from one without it)."""
    import openai

    from trainer.serve.testing import wait_for_endpoint
    from trainer.testing import start_trainer

    tmp, _, _, path = run
    model, _ = checkpoint.load_model(path, torch.device("cpu"), use_kernels=False)
    tok = from_tokenizer_json(str(tmp / "hf" / "tokenizer.json"))
    # At temperature 50 the draw is nearly uniform over 832 rows, so ~230 draws (4 prompts to
    # the 64-position context) miss every padded id (55 of 832) with probability ~1e-7.
    prompts = [offline.Prompt([tok.bos_id] + tok.encode(PROMPT))] * 4
    params = [SamplingParams(max_tokens=60, temperature=50.0, seed=s) for s in range(4)]

    def drawn(vocab):
        done = offline.generate(model, prompts, params, eos_id=-1, max_len=64, vocab=vocab)
        return [t for c in done for t in c.token_ids]

    assert max(drawn(None)) >= TOKENS  # the check below can fail
    limited = drawn(tok.vocab_size)
    assert len(limited) > 200 and max(limited) < TOKENS

    generate = {"prompt": PROMPT, "max_new_tokens": 12, "temperature": 1.0, "seed": 3}
    capsys.readouterr()
    assert job(tmp, "generate", "GENERATE", path, generate=generate) == 0
    printed = capsys.readouterr().out
    same = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.95, seed=3)
    assert PROMPT + engine_text(model, tok, same, TOKENS) in printed
    assert PROMPT + engine_text(model, tok, same, None) not in printed

    spec: dict[str, Any] = {"name": "padded-serve", "kind": "SERVE"}
    spec["trainer"] = {"checkpoint": {"path": str(path)}, "data": data_section(tmp)}
    config = write_job(tmp / "serve.yaml", spec)
    log = tmp / "serve.log"
    process = start_trainer("--config", config, "--run-dir", tmp / "serve", log_path=log)
    try:
        endpoint = wait_for_endpoint(log, process, timeout=300)
        client = openai.OpenAI(base_url=endpoint + "/v1", api_key="-", max_retries=0)
        got = client.completions.create(
            model="padded-serve", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5
        )
    finally:
        process.kill()
        process.wait()
    served = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    assert got.choices[0].text == engine_text(model, tok, served, TOKENS)
    assert got.choices[0].text != engine_text(model, tok, served, None)
