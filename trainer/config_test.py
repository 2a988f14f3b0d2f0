import torch

from protos import trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.config import train_dtype


def test_train_dtype_is_fp32_on_cpu_bf16_on_cuda():
    cfg = resolve_trainer(trainer_config_pb2.TrainerConfig())
    assert train_dtype(cfg, "cpu") == torch.float32
    assert train_dtype(cfg, "cuda") == torch.bfloat16
    cfg.train.dtype = "bf16"
    assert train_dtype(resolve_trainer(cfg), "cpu") == torch.bfloat16
