"""The batch the plan-versus-run tests feed Kitchen's model: packed rows, as precook makes."""

from protos import trainer_config_pb2


def tiny_batch(cfg: trainer_config_pb2.TrainerConfig):
    """Random tokens packed as two documents per row, as precook delivers them."""
    import torch

    from trainer.model import attention_layout

    B, T, V = cfg.train.micro_batch, cfg.data.seq_len, cfg.data.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    position_ids = torch.arange(T).repeat(B, 1)
    document_ids = torch.zeros(B, T, dtype=torch.int32)
    document_ids[:, T // 2 :] = 1
    position_ids[:, T // 2 :] -= T // 2
    labels = ids.roll(-1, dims=1)
    labels[:, T // 2 - 1] = labels[:, -1] = -100  # no target across a document's end
    return ids, position_ids, attention_layout(document_ids, "cpu", torch.float32), labels
