import pytest
import torch

from trainer.grad_noise import GradientNoiseScale, MicroBatchGradNorm
from trainer.lm_loss import summed_loss


def test_recovers_the_noise_scale_of_a_known_gradient_distribution():
    """Per-token gradients g_i = G + noise with covariance sigma^2 I (trace S = d sigma^2):
    B_simple = S / |G|^2, which the estimator must find from batch means alone."""
    g = torch.Generator().manual_seed(0)
    d, sigma, b_small, b_big = 64, 2.0, 32, 256
    true_grad = torch.full((d,), 0.25)  # |G|^2 = 4
    expected = d * sigma**2 / float(true_grad.pow(2).sum())  # 256 / 4 = 64 tokens
    noise = GradientNoiseScale()
    for _ in range(400):
        per_token = true_grad + sigma * torch.randn(b_big, d, generator=g)
        small = per_token[:b_small].mean(0).pow(2).sum()
        big = per_token.mean(0).pow(2).sum()
        noise.update(float(small), b_small, float(big), b_big)
    assert abs(noise.value - expected) / expected < 0.2, noise.value


def test_unknown_until_measured_and_ignores_degenerate_batches():
    noise = GradientNoiseScale()
    assert noise.value == 0.0
    noise.update(1.0, 10, 0.5, 10)  # no smaller batch: no estimate
    assert noise.value == 0.0
    noise.update(1.5, 10, 1.0, 20)  # |G|^2 = 0.5, S = 10: B_simple = 20 tokens
    copy = GradientNoiseScale()
    copy.load_state_dict(noise.state_dict())
    assert copy.value == noise.value == 20.0


@pytest.mark.parametrize("recompute", ["NONE", "FULL"])
def test_micro_batch_norm_is_the_norm_of_the_gradient_backward_computes(recompute):
    """The hooks' sum equals |p.grad|² after one backward pass from zero gradients, with tied
    embeddings (one parameter used twice) and with the blocks recomputed in backward."""
    from protos import trainer_config_pb2
    from protos.validation import resolve_trainer
    from trainer.model import Transformer
    from trainer.sizing.tiny_batch import tiny_batch

    torch.manual_seed(0)
    cfg = resolve_trainer(trainer_config_pb2.TrainerConfig())
    cfg.model.n_layers, cfg.data.seq_len, cfg.train.micro_batch = 2, 32, 2
    assert cfg.model.tie_embeddings
    model = Transformer(cfg.model, cfg.data.vocab_size, recompute=recompute)
    ids, position_ids, layout, labels = tiny_batch(cfg)
    loss = summed_loss(model, ids, position_ids, layout, labels)
    probe = MicroBatchGradNorm(loss)
    loss.backward()
    measured = probe.close()
    expected = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    assert measured == pytest.approx(expected, rel=1e-7)
    # Closed: a second backward pass adds nothing to it.
    summed_loss(model, ids, position_ids, layout, labels).backward()
    assert probe.close() == measured
