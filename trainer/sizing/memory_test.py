import pytest

from trainer.sizing import memory
from trainer.sizing.precision import SPECS, ZERO_PAPER_MIXED, Precision

N = 6_738_415_616  # Llama 2 7B


def test_mixed_precision_adam_is_16_bytes_per_parameter_under_ddp():
    st = memory.model_state_bytes(N, per_param=ZERO_PAPER_MIXED, sharding="ddp", world_size=8)
    assert (st.weights, st.gradients, st.optimizer + st.master) == (2 * N, 2 * N, 12 * N)
    assert st.total == 16 * N  # 107.8 GB: a 7B model does not fit one 80 GB GPU with DDP


@pytest.mark.parametrize(
    "states, sharding, per_param",
    [
        (ZERO_PAPER_MIXED, "zero1", 2 + 2 + 12 / 8),  # ZeRO paper: 4 + K/d with K = 12
        (ZERO_PAPER_MIXED, "zero2", 2 + 14 / 8),
        (ZERO_PAPER_MIXED, "zero3", 16 / 8),
        (SPECS[Precision.FP32].states, "ddp", 16),
        (SPECS[Precision.FP32].states, "zero1", 4 + 4 + 8 / 8),
        (SPECS[Precision.FP32].states, "zero2", 4 + 12 / 8),
        (SPECS[Precision.FP32].states, "zero3", 16 / 8),
        # autocast: 16-bit copies + fp32 gradients + Adam + the fp32 parameters as master
        (SPECS[Precision.BF16].states, "ddp", 2 + 4 + 8 + 4),
        (SPECS[Precision.BF16].states, "zero1", 2 + 4 + 12 / 8),
        (SPECS[Precision.FP8].states, "zero3", 17 / 8),
    ],
)
def test_sharding(states, sharding, per_param):
    st = memory.model_state_bytes(N, per_param=states, sharding=sharding, world_size=8)
    assert st.total == pytest.approx(per_param * N)


def test_activations_per_layer_by_hand():
    # Llama 2 7B at s=4096, b=1: s·b·h = 4096·4096 = 16,777,216; 5·a·s/h = 5·32 = 160.
    sbh = 4096 * 4096
    args = (4096, 1, 4096, 32)
    assert memory.activation_bytes_per_layer(*args, "none") == sbh * (34 + 160)
    assert memory.activation_bytes_per_layer(*args, "selective") == 34 * sbh
    assert memory.activation_bytes_per_layer(*args, "full") == 2 * sbh


def test_grouped_query_attention_keeps_smaller_keys_and_values():
    # Llama 3 8B's 8 KV heads of 32: K and V are a quarter of a hidden-sized tensor each, so
    # the layer keeps 2·(1 − 1/4) tensors of 2 bytes less per s·b·h than full MHA: 34 − 3.
    s, b, h, a = 4096, 1, 4096, 32
    mha = memory.activation_bytes_per_layer(s, b, h, a, "selective")
    gqa = memory.activation_bytes_per_layer(s, b, h, a, "selective", kv_heads=8)
    assert mha - gqa == s * b * h * 2 * (2 * (1 - 8 / 32))
    assert gqa == s * b * h * 31


def test_swiglu_ffn_dim_counts_three_ffn_wide_tensors():
    # Llama 3 8B's SwiGLU 14336 = 3.5·h: gate, up (kept by the fused SwiGLU) and their product
    # (the down projection's input), 3·3.5 = 10.5 hidden-sized tensors in place of the 4h GeLU
    # MLP's 8: 34 − 8·2 + 10.5·2 = 39 bytes per s·b·h.
    s, b, h, a = 4096, 1, 4096, 32
    got = memory.activation_bytes_per_layer(s, b, h, a, "selective", ffn_dim=14336)
    assert got == s * b * h * 39
    # A 4h-wide SwiGLU keeps 12 hidden-sized tensors, the 4h GeLU 8: the default is the GeLU.
    gelu = memory.activation_bytes_per_layer(s, b, h, a, "selective")
    swiglu_4h = memory.activation_bytes_per_layer(s, b, h, a, "selective", ffn_dim=4 * h)
    assert swiglu_4h - gelu == s * b * h * 4 * 2


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
    fp32 = SPECS[Precision.FP32].activations
    got = memory.activation_bytes_per_layer(s, b, h, a, sizes=fp32, dropout=False)
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
        ({"sharding": "zero4"}, "sharding"),
        ({"world_size": 0}, "world_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        memory.model_state_bytes(N, per_param=ZERO_PAPER_MIXED, **kwargs)
    with pytest.raises(ValueError, match="recompute"):
        memory.activation_bytes_per_layer(1, 1, 1, 1, "some")


def test_heads_wider_than_h_over_a_widen_q_k_v_and_the_attention_output():
    """Qwen3-30B-A3B's attention: 32 heads of 128 on h 2048 (a·Q = 2h), 4 key/value heads:
    q and o's input 2 tensors of 2h, k and v 2·(4/32)·2h, so 4 + 1 = 5 where a·Q = h gives 2.5."""
    plain = memory.layer_activations(2048, 32, kv_heads=4, ffn_dim=768, dropout=False)
    wide = memory.layer_activations(2048, 32, kv_heads=4, ffn_dim=768, dropout=False, head_dim=128)
    assert plain.attention == pytest.approx((2 + 2 * 4 / 32) * 2)
    assert wide.attention == pytest.approx(2 * plain.attention)
    same = memory.layer_activations(2048, 32, kv_heads=4, ffn_dim=768, dropout=False, head_dim=64)
    assert same == plain
    assert (wide.norm_inputs, wide.linear_inputs, wide.mlp) == (
        plain.norm_inputs,
        plain.linear_inputs,
        plain.mlp,
    )
