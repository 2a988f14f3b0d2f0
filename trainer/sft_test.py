"""SFT: fine-tune a pretrained checkpoint on prompt/response pairs with its own tokenizer."""

import torch

from protos.exit_codes import ExitCode
from trainer import main
from trainer.testing import chat_file, tiny_job, write_job

torch.set_num_threads(1)


def test_sft_starts_from_the_pretrained_weights_with_their_tokenizer(tmp_path, capsys):
    cache = tmp_path / "cache"
    pretrain = write_job(tmp_path / "pretrain.yaml", tiny_job(cache, steps=4))
    assert main.main(["--config", str(pretrain), "--run-dir", str(tmp_path / "pre")]) == 0
    (dataset,) = (cache / "datasets").iterdir()
    checkpoint = tmp_path / "pre" / "checkpoints" / "step_00000004"

    spec = tiny_job(cache, kind="SFT", steps=4, optim={"lr": 3e-4})
    spec["trainer"]["data"].update(
        input=str(chat_file(tmp_path / "chat.jsonl")),
        format="jsonl_chat",
        tokenizer="bpe_file",
        tokenizer_path=str(dataset / "tokenizer.json"),
        eval_fraction=0.05,
    )
    spec["trainer"]["checkpoint"] = {"path": str(checkpoint), "every_steps": 0}
    sft = write_job(tmp_path / "sft.yaml", spec)
    capsys.readouterr()
    assert main.main(["--config", str(sft), "--run-dir", str(tmp_path / "sft")]) == 0
    out = capsys.readouterr().out
    assert f"fine-tuning from {checkpoint} (step 4)" in out
    assert (tmp_path / "sft" / "checkpoints" / "step_00000004").is_dir()

    # A checkpoint with another vocabulary is refused, naming the field (exit 2).
    spec["trainer"]["data"].update(tokenizer="bpe_train", vocab_size=300)
    del spec["trainer"]["data"]["tokenizer_path"]
    mismatch = write_job(tmp_path / "mismatch.yaml", spec)
    code = main.main(["--config", str(mismatch), "--run-dir", str(tmp_path / "mismatch")])
    assert code == ExitCode.BAD_CONFIG
    assert "trainer.checkpoint.path" in capsys.readouterr().err
