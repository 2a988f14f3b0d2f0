"""The model with the fused Triton kernels equals the model with the PyTorch reference.

The Triton kernels run here in Triton's interpreter on CPU: TRITON_INTERPRET must be set
before `kernels` is imported (Bazel sets it for this target; so does the line below).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from protos import trainer_config_pb2  # noqa: E402
from protos.validation import resolve_trainer  # noqa: E402
from trainer.lm_loss import summed_loss
from trainer.model import Transformer, attention_layout, select_ops  # noqa: E402

torch.set_num_threads(1)
VOCAB = 300

pytestmark = pytest.mark.skipif(
    not kernels.triton_available("cpu"),
    reason="kernels was imported before TRITON_INTERPRET=1 was set (run this file alone)",
)


def model_config(moe_experts: int = 0):
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.seq_len = 16
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 64, 2, 4, 2
    cfg.model.moe_experts, cfg.model.moe_shared_experts = moe_experts, 1  # MoE: grouped GEMM
    return resolve_trainer(cfg).model


def test_select_ops_honours_use_kernels():
    assert select_ops(True, "cpu") is kernels
    assert select_ops(False, "cpu") is reference


@pytest.mark.parametrize("moe_experts", [0, 4], ids=["dense", "moe"])
def test_kernels_match_reference_loss_and_gradients(moe_experts):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 16))
    positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, -1)
    docs = torch.cat([torch.zeros(10), torch.ones(6)]).int().expand(2, -1)
    labels = ids.roll(-1, dims=1)
    labels[:, 9] = labels[:, 15] = -100  # last token of each document has no target
    results = []
    for ops in (kernels, reference):
        torch.manual_seed(1)
        model = Transformer(model_config(moe_experts), VOCAB, ops=ops)
        loss = summed_loss(
            model, ids, positions, attention_layout(docs, "cpu", torch.float32), labels
        )
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_k, grads_k), (loss_r, grads_r) = results
    torch.testing.assert_close(loss_k, loss_r, rtol=1e-5, atol=1e-4)
    for name, grad in grads_r.items():
        torch.testing.assert_close(grads_k[name], grad, rtol=1e-4, atol=1e-5, msg=name)
