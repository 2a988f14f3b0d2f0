"""plan's memory section: model states by sharding, activations by recompute mode, what fits,
for the precision trained in (the formulas: memory.py; what each precision keeps:
precision.py)."""

from typing import Any

from trainer.sizing import memory
from trainer.sizing.comm import ModelShape
from trainer.sizing.params import llama_param_count
from trainer.sizing.precision import SPECS, Precision
from trainer.sizing.report import Fit, MemorySection, ModelStates, q


def _per_param_formula(per_param: float, sharded: bool) -> str:
    return f"{per_param:g}·N{'/R' if sharded else ''}" if per_param else "0"


def section(
    s: ModelShape,
    precision: Precision,
    *,
    held_params: float,
    ranks: int,
    seq_len: int,
    micro_batch: int,
    attention: str,
    dropout: bool,
    memory_gib: float,
) -> MemorySection:
    """`held_params`: parameters each GPU holds before sharding (every expert of an MoE);
    `ranks`: the data-parallel ranks sharding them."""
    L, d, H, V, T, b = s.layers, s.dim, s.heads, s.vocab, seq_len, micro_batch
    spec = SPECS[precision]
    per = spec.states
    states, state_bytes = {}, {}
    for level, sharding in enumerate(memory.SHARDINGS):
        st = memory.model_state_bytes(
            held_params, per_param=per, sharding=sharding, world_size=ranks
        )
        state_bytes[sharding] = st.total
        states[sharding] = ModelStates(
            weights=q(st.weights, "B", _per_param_formula(per.weights, level >= 3)),
            gradients=q(st.gradients, "B", _per_param_formula(per.gradients, level >= 2)),
            optimizer=q(st.optimizer, "B", _per_param_formula(per.optimizer, level >= 1)),
            master=q(st.master, "B", _per_param_formula(per.master, level >= 1)),
            total=q(st.total, "B", "weights + gradients + optimizer + master"),
        )
    flash = attention == "flash"
    sizes = spec.activations
    modes = memory.RECOMPUTE_MODES
    act, back, act_bytes, back_bytes = {}, {}, {}, {}
    for mode in modes:
        kw: dict[str, Any] = dict(
            sizes=sizes,
            dropout=dropout,
            flash_attention=flash,
            kv_heads=s.kv_heads,
            ffn_dim=s.ffn_dim,
            head_dim=s.head_dim,
        )
        layer = memory.layer_activations(d, H, mode, **kw)
        act_bytes[mode] = memory.activation_bytes_per_layer(T, b, d, H, mode, **kw)
        back_bytes[mode] = memory.backward_transient_bytes(T, b, d, H, V, mode, **kw)
        act[mode] = q(act_bytes[mode], "B", layer.formula(mode, sizes.residual))
        rebuilt = "" if mode == "none" else f" + one layer rebuilt (none − {mode})"
        back[mode] = q(back_bytes[mode], "B", "4·s·b·V" + rebuilt)
    # The same layer in every precision, beside the chosen one: what switching would save.
    by_precision = {
        p.value: memory.activation_bytes_per_layer(
            T, b, d, H, "none", **{**kw, "sizes": SPECS[p].activations}
        )
        for p in Precision
    }
    e = sizes.linear_input
    out = memory.output_layer_activation_bytes(T, b, d, V, bytes_per_element=e)
    usable = memory.usable_bytes(memory_gib)
    # ZeRO-3/FSDP gathers each layer's whole weights before it runs: the running layer's and
    # the prefetched next one's are whole at once, in the weights' dtype (2 bytes: FSDP2
    # gathers the bf16 cast, or fp32 weights in fp32).
    layer_params = llama_param_count(d, L, H, s.kv_heads, s.ffn_dim, V, s.tie_embeddings).per_layer
    gathered = {sharding: 0.0 for sharding in memory.SHARDINGS}
    gathered["zero3"] = 2 * layer_params * (4 if precision is Precision.FP32 else 2)
    fits: dict[str, dict[str, Fit]] = {}
    for sharding in memory.SHARDINGS:
        fits[sharding] = {}
        for mode in modes:
            peak = state_bytes[sharding] + L * act_bytes[mode] + out + back_bytes[mode]
            peak += gathered[sharding]
            fits[sharding][mode] = Fit(bytes=peak, fits=peak <= usable)
    return MemorySection(
        precision=precision.value,
        precision_note=spec.note,
        bytes_per_param={
            "weights": per.weights,
            "gradients": per.gradients,
            "optimizer": per.optimizer,
            "master": per.master,
            "total": per.total,
        },
        model_states=states,
        activations_per_layer=act,
        activations_by_precision=by_precision,
        activation_note=f"{sizes.element}-byte activations, {sizes.residual}-byte residual"
        + (", a cast per projection" if sizes.input_cast_per_projection else "")
        + (", dropout masks (the paper's)" if dropout else ", no dropout (Kitchen's blocks)")
        + f", {attention} attention",
        output_layer=q(out, "B", f"2·s·b·h·{e} + 4·s·b·V (fp32 logits for the loss)"),
        backward_transient=back,
        device_memory=q(memory_gib * memory.GIB, "B", "accelerator table (or --memory-gib / RAM)"),
        usable_memory=q(usable, "B", "90% (runtime, fragmentation, buffers)"),
        fits=fits,
        fits_formula="model states + L × activations per layer + output layer + backward"
        " (+ ZeRO-3: 2 gathered layers)",
    )
