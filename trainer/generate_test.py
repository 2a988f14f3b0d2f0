import torch

from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.generate import generate, sample_next
from trainer.model import Transformer

torch.set_num_threads(1)
VOCAB = 300


def tiny_model():
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.seq_len = 64
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 64, 2, 4, 2
    cfg.model.tie_embeddings = False
    torch.manual_seed(0)
    model = Transformer(resolve_trainer(cfg).model, VOCAB)
    with torch.no_grad():  # sharper logits than at init, so greedy choices are not near-ties
        model.output.weight.mul_(10)
    return model.eval()


@torch.no_grad()
def greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor([ids])
        ids.append(int(model(x, torch.arange(len(ids))[None])[0, -1].argmax()))
    return ids[len(prompt) :]


def test_kv_cache_greedy_equals_recomputing_everything():
    model = tiny_model()
    prompt = [1, 17, 42, 99, 5]
    cached, tokens_per_s = generate(model, prompt, 30, temperature=0, max_len=64)
    assert cached == greedy_without_cache(model, prompt, 30)
    assert tokens_per_s > 0


def test_generation_stops_at_the_position_limit_and_the_stop_token():
    model = tiny_model()
    out, _ = generate(model, [1] * 60, 100, temperature=0, max_len=64)
    assert len(out) == 4
    first, _ = generate(model, [1, 2, 3], 5, temperature=0, max_len=64)
    assert first[0] != first[1]
    stopped, _ = generate(model, [1, 2, 3], 5, temperature=0, max_len=64, stop_id=first[1])
    assert stopped == first[:2]


def test_sampling_is_seeded_and_filters_work():
    model = tiny_model()
    a, _ = generate(model, [1, 2], 20, temperature=1.0, top_k=0, top_p=1.0, seed=3, max_len=64)
    b, _ = generate(model, [1, 2], 20, temperature=1.0, top_k=0, top_p=1.0, seed=3, max_len=64)
    c, _ = generate(model, [1, 2], 20, temperature=1.0, top_k=0, top_p=1.0, seed=4, max_len=64)
    assert a == b and a != c
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    g = torch.Generator().manual_seed(0)
    assert {int(sample_next(logits, 1.0, 1, 1.0, g)) for _ in range(50)} == {1}  # top-k 1
    assert {int(sample_next(logits, 1.0, 2, 1.0, g)) for _ in range(200)} == {1, 3}
    # Top-p 0.5: token 1 alone holds ~47% < 50%, so token 3 joins; the rest never appear.
    assert {int(sample_next(logits, 1.0, 0, 0.5, g)) for _ in range(200)} == {1, 3}
    assert {int(sample_next(logits, 1.0, 0, 0.01, g)) for _ in range(50)} == {1}
