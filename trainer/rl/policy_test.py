"""Batched KV-cache rollouts decode exactly what one-at-a-time generation does, and a batch's
response mask lines up with the tokens it scores."""

import torch

from protos import trainer_config_pb2
from protos.defaults import with_defaults
from trainer.generate import generate
from trainer.model import Transformer
from trainer.rl import policy

torch.set_num_threads(1)


def tiny_model(vocab: int = 64) -> Transformer:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 32, 2, 4
    cfg.data.seq_len = 64
    torch.manual_seed(0)
    return Transformer(with_defaults(cfg).model, vocab).eval()


def test_batched_greedy_rollouts_match_one_sequence_at_a_time():
    model = tiny_model()
    prompts = [[1, 5, 9], [1, 7, 3], [1, 2, 3, 4, 5], [1, 5, 9]]  # two lengths, one repeated
    eos = 11
    out = policy.sample(
        model, prompts, 2, 12, temperature=0, eos_id=eos,
        generator=torch.Generator().manual_seed(0), max_len=64,
    )  # fmt: skip
    assert len(out) == 8
    for i, row in enumerate(out):
        prompt = prompts[i // 2]
        alone, _ = generate(
            model, prompt, 12, temperature=0, top_k=0, top_p=1.0, stop_id=eos, max_len=64
        )
        assert row == prompt + alone, i


def test_a_batch_masks_exactly_the_response_tokens():
    model = tiny_model()
    seqs = [policy.layout(1, [5, 6], [7, 8, 2], 64), policy.layout(1, [5], [9], 64)]
    assert seqs[0] == ([1, 5, 6, 7, 8, 2], 3)
    batch = policy.make_batch(seqs, 0, torch.device("cpu"))
    assert batch.ids.tolist() == [[1, 5, 6, 7, 8, 2], [1, 5, 9, 0, 0, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch.last.tolist() == [5, 2] and batch.response_lengths == [3, 1]
    logps = policy.token_logps(model, batch)
    logits = model(batch.ids, torch.arange(6)[None].expand(2, -1))
    expected = logits[1, 1].log_softmax(-1)[9]  # the one response token of row 2
    assert torch.allclose(logps[1, 1], expected, atol=1e-5)


def test_a_long_prompt_keeps_its_end_and_room_for_a_response():
    ids, start = policy.layout(1, list(range(10, 30)), [7, 8], 8)
    assert ids == [1, 24, 25, 26, 27, 28, 29, 7] and start == 7
