"""Rollouts from the inference engine decode exactly what one-at-a-time generation does, report
the log-probabilities the trainer recomputes, and a batch's response mask lines up with the
tokens it scores."""

import torch

from protos import trainer_config_pb2
from protos.defaults import with_defaults
from trainer.generate import generate
from trainer.inference.testing import EOS
from trainer.inference.testing import tiny_model as wide_model
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
    ).sequences  # fmt: skip
    assert len(out) == 8
    for i, row in enumerate(out):
        prompt = prompts[i // 2]
        alone, _ = generate(
            model, prompt, 12, temperature=0, top_k=0, top_p=1.0, stop_id=eos, max_len=64
        )
        assert row == prompt + alone, i


def max_logprob_difference(model, rollouts, prompts, n) -> float:
    """Max |engine log pi - token_logps| over every response token of `rollouts`."""
    starts = [len(prompts[i // n]) for i in range(len(rollouts.sequences))]
    batch = policy.make_batch(list(zip(rollouts.sequences, starts, strict=True)), 0, "cpu")
    with torch.no_grad():
        recomputed = policy.token_logps(model, batch)
    worst = 0.0
    for b, (seq, start) in enumerate(zip(rollouts.sequences, starts, strict=True)):
        assert len(rollouts.logprobs[b]) == len(seq) - start
        engine = torch.tensor(rollouts.logprobs[b])
        worst = max(worst, float((engine - recomputed[b, start - 1 : len(seq) - 1]).abs().max()))
    return worst


def test_engine_logprobs_equal_the_trainers_recomputed_ones_on_the_live_weights(capsys):
    """fp32 on CPU: the engine's log pi(token) of every sampled token is token_logps's on the
    same sequences, to 1e-5, before and after an optimizer step on the policy (the engine
    reads the live parameters)."""
    model = wide_model(max_seq_len=64)
    prompts = [[1, 5, 9], [1, 7, 3, 2], [1, 2, 3, 4, 5, 6, 7]]
    kw = dict(temperature=0.8, eos_id=EOS, max_len=64)
    out = policy.sample(model, prompts, 4, 20, generator=torch.Generator().manual_seed(0), **kw)
    before = max_logprob_difference(model, out, prompts, 4)
    assert any(seq[-1] == EOS for seq in out.sequences)  # some end at EOS, scored with it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    starts = [len(prompts[i // 4]) for i in range(len(out.sequences))]
    batch = policy.make_batch(list(zip(out.sequences, starts, strict=True)), 0, "cpu")
    (-(policy.token_logps(model, batch) * batch.mask).sum()).backward()
    optimizer.step()
    again = policy.sample(model, prompts, 4, 20, generator=torch.Generator().manual_seed(0), **kw)
    after = max_logprob_difference(model, again, prompts, 4)
    assert again.sequences != out.sequences  # the step changed the policy the engine samples
    with capsys.disabled():
        print(f"\nengine vs token_logps, max abs difference: {before:.2e} before, "
              f"{after:.2e} after an optimizer step")  # fmt: skip
    assert before <= 1e-5 and after <= 1e-5


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
