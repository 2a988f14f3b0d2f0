import torch

from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.generate import generate
from trainer.inference.testing import greedy_full_forward
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


def test_engine_greedy_equals_recomputing_everything():
    model = tiny_model()
    prompt = [1, 17, 42, 99, 5]
    cached, tokens_per_s = generate(model, prompt, 30, temperature=0, max_len=64)
    assert cached == greedy_full_forward(model, prompt, 30)
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
