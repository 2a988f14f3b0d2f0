"""The MoE layer: grouped compute equals routing token by token; capacity drops and counts;
balancing terms move gradients, not the loss; the statistics read 1 when even and E when
collapsed; the aux-free bias moves towards idle experts; FLOPs count active experts only."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer import moe
from trainer.lm_loss import summed_loss
from trainer.model import Transformer

DIM, EXPERTS = 16, 4


def _cfg(**model) -> trainer_config_pb2.TrainerConfig:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.seq_len = 8
    fields = {**dict(dim=DIM, n_layers=2, n_heads=2, moe_experts=EXPERTS, moe_ffn_dim=24), **model}
    for name, value in fields.items():
        if isinstance(value, str):
            value = getattr(trainer_config_pb2, value)
        setattr(cfg.model, name, value)
    return resolve_trainer(cfg)


def _layer(**model) -> moe.MoEFeedForward:
    torch.manual_seed(0)
    layer = moe.MoEFeedForward(_cfg(**model).model, reference, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _expert(layer, e, x):
    gate, up = (x @ layer.experts.w13[e]).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ layer.experts.w2[e]


@pytest.mark.parametrize("gate", ["SOFTMAX", "SIGMOID"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_grouped_compute_equals_routing_token_by_token(gate, top_k):
    layer = _layer(moe_gate=gate, moe_top_k=top_k, moe_shared_experts=1)
    x = torch.randn(3, 5, DIM)
    got = layer(x)
    assert layer.shared is not None
    expected = torch.zeros_like(x)
    for b in range(3):
        for t in range(5):
            token = x[b, t]
            logits = layer.router.weight @ token
            scores = torch.softmax(logits, -1) if gate == "SOFTMAX" else torch.sigmoid(logits)
            chosen = torch.topk(scores, top_k).indices
            weights = scores[chosen] / (scores[chosen].sum() if top_k > 1 else 1.0)
            for w, e in zip(weights, chosen.tolist(), strict=True):
                expected[b, t] += w * _expert(layer, e, token)
            expected[b, t] += layer.shared(token)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def _collapsed(layer):
    """Every token's router logit for expert 0 far above the rest."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 50.0
    return torch.rand(2, 10, DIM) + 0.5  # positive inputs: expert 0 wins everywhere


def test_capacity_drops_the_latecomers_and_counts_them():
    layer = _layer(moe_top_k=1, moe_capacity_factor=1.0)
    x = _collapsed(layer)
    out = layer(x).reshape(20, DIM)
    capacity = layer.capacity(20)
    assert capacity == math.ceil(20 / EXPERTS) == 5
    # The first 5 tokens reach expert 0 (gate ~1); the other 15 are dropped: zero output.
    torch.testing.assert_close(
        out[:5], _expert(layer, 0, x.reshape(20, DIM)[:5]), rtol=1e-4, atol=1e-5
    )
    assert not out[5:].any()
    moe.collect(layer)
    stats = moe.progress_fields(layer)
    assert stats["moe_dropped_fraction"] == pytest.approx(15 / 20)
    assert list(stats["moe_layers"][0].tokens_per_expert) == [20, 0, 0, 0]


def test_statistics_read_even_and_collapsed():
    even = _layer(moe_top_k=1)
    with torch.no_grad():
        even.router.weight.zero_()  # uniform probabilities: aux exactly 1, entropy 1
    even(torch.randn(2, 10, DIM))
    moe.collect(even)
    s = moe.progress_fields(even)["moe_layers"][0]
    assert s.aux_loss == pytest.approx(1.0) and s.router_entropy == pytest.approx(1.0)
    assert s.z_loss == pytest.approx(math.log(EXPERTS) ** 2, rel=1e-5)

    collapsed = _layer(moe_top_k=1)
    collapsed(_collapsed(collapsed))
    moe.collect(collapsed)
    fields = moe.progress_fields(collapsed)
    s = fields["moe_layers"][0]
    assert s.aux_loss == pytest.approx(EXPERTS, rel=1e-3)  # E · 1 · 1
    assert s.imbalance == pytest.approx(EXPERTS) == fields["moe_max_imbalance"]
    assert s.router_entropy < 1e-3
    assert s.micro_batch_imbalance == pytest.approx(EXPERTS)
    # Reported once: the next report starts from zero.
    assert moe.progress_fields(collapsed)["moe_layers"][0].tokens_per_expert == [0] * EXPERTS


def test_aux_free_bias_moves_towards_idle_experts():
    layer = _layer(moe_top_k=1, moe_balance="AUX_FREE_BIAS", moe_bias_update_rate=0.01)
    layer(_collapsed(layer))
    moe.collect(layer)
    moe.end_step(layer, updated=True)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    moe.end_step(layer, updated=True)  # no tokens since: the load is even, nothing moves
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


def _model(**model) -> Transformer:
    torch.manual_seed(0)
    return Transformer(_cfg(**model).model, vocab_size=32)


def test_balancing_terms_train_the_router_without_changing_the_loss():
    ids = torch.randint(0, 32, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    losses, grads = [], []
    for coef in (0.0, 1.0):
        model = _model(moe_aux_loss_coef=coef, moe_z_loss_coef=coef)
        loss = summed_loss(model, ids, pos, None, ids)
        loss.backward()
        losses.append(loss.item())
        grads.append(model.layers[0].feed_forward.router.weight.grad.clone())
    assert losses[0] == losses[1]
    assert not torch.allclose(grads[0], grads[1])


def test_matmul_params_count_the_active_experts_only():
    # 8 experts of half the dense width, 2 active: the dense MLP's matmuls plus the router.
    dense = _model(moe_experts=0)
    sparse = _model(
        moe_experts=8, moe_top_k=2, moe_ffn_dim=dense.layers[0].feed_forward.w1.weight.shape[0] // 2
    )
    routers = 2 * 8 * DIM
    assert sparse.matmul_params() == dense.matmul_params() + routers
    assert sum(p.numel() for p in sparse.parameters()) > 3 * sparse.matmul_params() // 2


def test_every_kth_layer():
    model = _model(moe_every=2)
    kinds = [type(block.feed_forward).__name__ for block in model.layers]
    assert kinds == ["SwiGLUMLP", "MoEFeedForward"]
