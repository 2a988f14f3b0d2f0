"""The trainer's reading of a resolved TrainerConfig that needs torch: the compute dtype.

Defaults and validation are not here: they live with the schema (protos/defaults.py,
protos/validation.py), because the launcher applies the same rules at submit.
"""

import torch

from protos import trainer_config_pb2
from protos.defaults import DTYPES


def train_dtype(cfg: trainer_config_pb2.TrainerConfig, device) -> torch.dtype:
    """The compute dtype: `train.dtype`, or bf16 on CUDA and fp32 elsewhere when it is empty."""
    name = DTYPES[cfg.train.dtype.lower()]
    if name is None:
        name = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    return getattr(torch, name)
