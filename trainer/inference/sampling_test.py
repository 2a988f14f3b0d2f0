import torch

from trainer.inference.sampling import argmax_rows, sample_next, token_logprobs


def test_top_k_and_top_p_keep_only_the_tokens_they_should():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    g = torch.Generator().manual_seed(0)
    assert {int(sample_next(logits, 1.0, 1, 1.0, g)) for _ in range(50)} == {1}  # top-k 1
    assert {int(sample_next(logits, 1.0, 2, 1.0, g)) for _ in range(200)} == {1, 3}
    # Top-p 0.5: token 1 alone holds ~47% < 50%, so token 3 joins; the rest never appear.
    assert {int(sample_next(logits, 1.0, 0, 0.5, g)) for _ in range(200)} == {1, 3}
    assert {int(sample_next(logits, 1.0, 0, 0.01, g)) for _ in range(50)} == {1}
    assert int(sample_next(logits, 0, 0, 1.0, g)) == 1  # temperature 0: greedy


def test_token_logprobs_are_the_log_softmax_at_temperature_one():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [1.0, 1.0, 1.0, 1.0]])
    got = token_logprobs(logits, [3, 0])
    want = logits.log_softmax(-1)[[0, 1], [3, 0]].tolist()
    assert got == want and abs(got[1] - float(torch.log(torch.tensor(0.25)))) < 1e-7


def test_argmax_rows_is_argmax_first_of_ties_included():
    torch.manual_seed(0)
    logits = torch.randn(32, 4096)
    logits[3, 100] = logits[3, 4000] = 50.0  # a tie across blocks: the first wins
    logits[5, 70] = logits[5, 71] = 50.0  # inside one block
    logits[7, :] = 1.0  # all equal: index 0
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[3] == 100 and argmax_rows(logits)[5] == 70
    for shape in ((1, 4096), (32, 100)):  # one row; a vocabulary not in whole blocks
        x = torch.randn(shape)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
