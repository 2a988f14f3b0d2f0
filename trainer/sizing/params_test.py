from protos.defaults import ffn_dim_for
from trainer.sizing.params import llama_param_count


def test_public_llama_parameter_counts():
    # The published totals: Llama 2 7B 6,738,415,616; Llama 3 8B 8,030,261,248;
    # Llama 3 70B 70,553,706,496 (untied embeddings).
    assert llama_param_count(4096, 32, 32, 32, 11008, 32000, False).total == 6_738_415_616
    assert llama_param_count(4096, 32, 32, 8, 14336, 128256, False).total == 8_030_261_248
    assert llama_param_count(8192, 80, 64, 8, 28672, 128256, False).total == 70_553_706_496


def test_non_embedding_counts_the_output_projection_once():
    untied = llama_param_count(4096, 32, 32, 32, 11008, 32000, False)
    assert untied.non_embedding == untied.total - 32000 * 4096 - 4096  # less the final norm
    # Kitchen's default tiny model: d 256, 4 layers, 8 heads, vocab 4096, tied embeddings.
    tied = llama_param_count(256, 4, 8, 8, ffn_dim_for(256), 4096, True)
    # The one table is the output matmul's weight: only the final norm is left out.
    assert tied.non_embedding == tied.total - 256
    # By hand: 4·(4·256² + 3·256·704 + 2·256) + 256 + 4096·256 = 4,262,144.
    assert tied.total == 4_262_144


def test_grouped_query_attention_shrinks_only_k_and_v():
    full = llama_param_count(1024, 1, 16, 16, 2816, 1000, True).per_layer
    gqa = llama_param_count(1024, 1, 16, 4, 2816, 1000, True).per_layer
    # k and v go from d·d to d·(4·64) each: 2·1024·(1024 − 256) fewer.
    assert full - gqa == 2 * 1024 * 768
