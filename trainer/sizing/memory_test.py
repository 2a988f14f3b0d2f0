import pytest

from trainer.sizing import memory

N = 6_738_415_616  # Llama 2 7B


def test_mixed_precision_adam_is_16_bytes_per_parameter_under_ddp():
    st = memory.model_state_bytes(N, layout="mixed", sharding="ddp", world_size=8)
    assert (st.weights, st.gradients, st.optimizer) == (2 * N, 2 * N, 12 * N)
    assert st.total == 16 * N  # 107.8 GB: a 7B model does not fit one 80 GB GPU with DDP


@pytest.mark.parametrize(
    "layout, sharding, per_param",
    [
        ("mixed", "zero1", 2 + 2 + 12 / 8),  # ZeRO paper: 4 + K/d with K = 12
        ("mixed", "zero2", 2 + 14 / 8),
        ("mixed", "zero3", 16 / 8),
        ("fp32", "ddp", 16),
        ("fp32", "zero1", 4 + 4 + 8 / 8),
        ("fp32", "zero2", 4 + 12 / 8),
        ("fp32", "zero3", 16 / 8),
    ],
)
def test_sharding(layout, sharding, per_param):
    st = memory.model_state_bytes(N, layout=layout, sharding=sharding, world_size=8)
    assert st.total == pytest.approx(per_param * N)


def test_activations_per_layer_by_hand():
    # Llama 2 7B at s=4096, b=1: s·b·h = 4096·4096 = 16,777,216; 5·a·s/h = 5·32 = 160.
    sbh = 4096 * 4096
    args = (4096, 1, 4096, 32)
    assert memory.activation_bytes_per_layer(*args, "none") == sbh * (34 + 160)
    assert memory.activation_bytes_per_layer(*args, "selective") == 34 * sbh
    assert memory.activation_bytes_per_layer(*args, "full") == 2 * sbh


def test_selective_recompute_saves_70_percent_for_gpt3():
    # Korthikanti et al. 2022: for GPT-3 175B (s=2048, h=12288, a=96), 5as/h = 80 against 34,
    # so recomputing only the attention scores removes 70% of the activation memory.
    none = memory.activation_bytes_per_layer(2048, 1, 12288, 96, "none")
    selective = memory.activation_bytes_per_layer(2048, 1, 12288, 96, "selective")
    assert 1 - selective / none == pytest.approx(0.70, abs=0.005)


def test_fp32_without_dropout_counts_elements_at_4_bytes():
    # Without dropout there are no masks and no dropout output: 16 hidden-sized tensors and
    # one score-sized tensor (the softmax output), 4 bytes each.
    s, b, h, a = 256, 8, 256, 8
    got = memory.activation_bytes_per_layer(s, b, h, a, bytes_per_element=4, dropout=False)
    assert got == s * b * h * 16 * 4 + a * s * s * b * 4


def test_backward_transient():
    s, b, h, a, v = 256, 8, 256, 8, 4096
    logits_grad = 4 * s * b * v
    assert memory.backward_transient_bytes(s, b, h, a, v, "none") == logits_grad
    none = memory.activation_bytes_per_layer(s, b, h, a, "none")
    full = memory.activation_bytes_per_layer(s, b, h, a, "full")
    assert memory.backward_transient_bytes(s, b, h, a, v, "full") == logits_grad + none - full


def test_output_layer():
    # 2·s·b·h·2 + 4·s·b·V for s=4096, b=1, h=4096, V=32000.
    assert memory.output_layer_activation_bytes(4096, 1, 4096, 32000) == (
        2 * 4096 * 4096 * 2 + 4 * 4096 * 32000
    )


def test_usable_bytes_keeps_headroom():
    assert memory.usable_bytes(80) == 0.9 * 80 * 2**30


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"layout": "fp8"}, "layout"),
        ({"sharding": "zero4"}, "sharding"),
        ({"world_size": 0}, "world_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        memory.model_state_bytes(N, **kwargs)
    with pytest.raises(ValueError, match="recompute"):
        memory.activation_bytes_per_layer(1, 1, 1, 1, "some")
