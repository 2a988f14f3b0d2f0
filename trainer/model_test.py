import pytest
import torch

from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.lm_loss import summed_loss
from trainer.model import Layout, Transformer, attention_layout

torch.set_num_threads(1)
VOCAB = 300


def tiny(**model):
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.seq_len = 32
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 64, 2, 4
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return resolve_trainer(cfg).model


def build(seed=0, recompute="NONE", **model):
    torch.manual_seed(seed)
    return Transformer(tiny(**model), VOCAB, recompute=recompute)


def packed_row(doc_a: torch.Tensor, doc_b: torch.Tensor, pad: int = 0):
    """One row: document 0, document 1, then padding; positions restart per document."""
    ids = torch.cat([doc_a, doc_b, torch.zeros(pad, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(len(doc_a)), torch.arange(len(doc_b)), torch.zeros(pad)])
    docs = torch.cat([torch.zeros(len(doc_a)), torch.ones(len(doc_b)), -torch.ones(pad)])
    return ids, positions.long()[None], docs.int()[None]


def logits_of(model, ids, positions, docs):
    return model(ids, positions, attention_layout(docs, "cpu", torch.float32))


def test_shapes_and_loss():
    model = build()
    ids = torch.randint(0, VOCAB, (3, 32))
    positions = torch.arange(32).expand(3, -1)
    assert model(ids, positions).shape == (3, 32, VOCAB)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    loss = summed_loss(model, ids, positions, None, labels)
    assert loss.shape == () and torch.isfinite(loss)
    # The summed loss of a fresh model is about ln(vocab) per labelled token.
    per_token = loss.item() / (3 * 31)
    assert abs(per_token - torch.log(torch.tensor(float(VOCAB)))) < 0.5


def test_tied_embeddings_share_one_tensor():
    m = build()
    assert m.output.weight is m.tok_embeddings.weight
    m = build(tie_embeddings=False)
    assert m.output.weight is not m.tok_embeddings.weight


def test_attention_does_not_cross_documents():
    model = build()
    a, b = torch.randint(0, VOCAB, (12,)), torch.randint(0, VOCAB, (9,))
    base = logits_of(model, *packed_row(a, b, pad=3))
    # Changing document 1 leaves every output of document 0 as it was, and vice versa.
    changed_b = logits_of(model, *packed_row(a, torch.randint(0, VOCAB, (9,)), pad=3))
    torch.testing.assert_close(changed_b[0, :12], base[0, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(changed_b[0, 12:21], base[0, 12:21])
    changed_a = logits_of(model, *packed_row(torch.randint(0, VOCAB, (12,)), b, pad=3))
    torch.testing.assert_close(changed_a[0, 12:21], base[0, 12:21], rtol=0, atol=1e-5)
    # A packed document gives what it gives alone (its positions restart at 0).
    alone = model(b[None], torch.arange(9)[None])
    torch.testing.assert_close(base[0, 12:21], alone[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(base).all()  # padding rows attend to padding, no NaN


def test_causal_fast_path_when_one_document_per_row():
    docs = torch.zeros(2, 8, dtype=torch.int32)
    assert attention_layout(docs, "cpu", torch.float32) == Layout()
    docs[1, 4:] = 1
    mask = attention_layout(docs, "cpu", torch.float32).mask
    assert mask is not None and mask.shape == (2, 1, 8, 8)


def test_grouped_query_attention_matches_repeated_heads():
    gqa = build(n_kv_heads=2)
    assert gqa.layers[0].attention.wk.weight.shape == (2 * 16, 64)
    mha = build(n_kv_heads=4)
    # Copy the GQA weights into a full multi-head model by repeating each KV head.
    state = gqa.state_dict()
    for name in list(state):
        if name.endswith(("wk.weight", "wv.weight")):
            state[name] = state[name].view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
    mha.load_state_dict(state)
    ids, positions, docs = packed_row(torch.randint(0, VOCAB, (10,)), torch.randint(0, VOCAB, (6,)))
    torch.testing.assert_close(
        logits_of(gqa, ids, positions, docs), logits_of(mha, ids, positions, docs)
    )


@pytest.mark.parametrize("recompute", ["SELECTIVE", "FULL"])
def test_recompute_gives_the_same_gradients(recompute):
    ids = torch.randint(0, VOCAB, (2, 32))
    positions = torch.arange(32).expand(2, -1)
    labels = ids.roll(-1, dims=1)
    grads = []
    for mode in ("NONE", recompute):
        model = build(recompute=mode)
        summed_loss(model, ids, positions, None, labels).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_matmul_params_counts_blocks_and_head():
    model = build()
    blocks = sum(p.numel() for p in model.layers.parameters())
    assert model.matmul_params() == blocks + VOCAB * 64
