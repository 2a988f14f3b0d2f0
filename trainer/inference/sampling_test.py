import torch

from trainer.inference.sampling import argmax_rows, sample, token_logprobs


def draws(logits, temperature=1.0, top_k=0, top_p=1.0, n=200, seed=0) -> set[int]:
    g = torch.Generator().manual_seed(seed)
    return {sample(logits, [temperature], [top_k], [top_p], [g])[0] for _ in range(n)}


def test_top_k_and_top_p_keep_only_the_tokens_they_should():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    assert draws(logits, top_k=1, n=50) == {1}
    assert draws(logits, top_k=2) == {1, 3}
    # Top-p 0.5: token 1 alone holds ~47% < 50%, so token 3 joins; the rest never appear.
    assert draws(logits, top_p=0.5) == {1, 3}
    assert draws(logits, top_p=0.01, n=50) == {1}
    assert draws(logits) == {0, 1, 2, 3}
    assert draws(logits, temperature=0, n=5) == {1}  # greedy


def test_draws_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    got = torch.tensor([sample(logits, [1.0], [0], [1.0], [g])[0] for _ in range(4000)])
    freq = torch.bincount(got, minlength=3).float() / len(got)
    assert (freq - logits[0].softmax(-1)).abs().max() < 0.03


def test_a_rows_draws_depend_on_its_generator_not_on_the_other_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 4096)
    temperature = [0.7, 1.0, 0.0, 1.3, 0.9, 1.0]
    top_k = [0, 50, 0, 10, 0, 0]
    top_p = [1.0, 0.9, 1.0, 0.8, 1.0, 0.5]

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    together = sample(logits, temperature, top_k, top_p, [gen(s) for s in range(6)])
    alone = [
        sample(logits[i : i + 1], [temperature[i]], [top_k[i]], [top_p[i]], [gen(i)])[0]
        for i in range(6)
    ]
    assert together == alone


def test_token_logprobs_are_the_log_softmax_at_temperature_one():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [1.0, 1.0, 1.0, 1.0]])
    got, top = token_logprobs(logits, [3, 0], [2, 0])
    logp = logits.log_softmax(-1)
    want = logp[[0, 1], [3, 0]].tolist()
    assert got == want and abs(got[1] - float(torch.log(torch.tensor(0.25)))) < 1e-7
    assert top == [((1, logp[0, 1].item()), (3, logp[0, 3].item())), ()]


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
