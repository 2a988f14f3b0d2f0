"""The rules particular to one kind of job (part of rule 3, protos/validation.py): the
post-training kinds (REWARD, DPO, PPO: `validate_rl`; DISTILL: `validate_distill`), the jobs
that read images (VLM: `validate_vision`) and the serve job (`validate_serve`)."""

from protos import enums, job_pb2, trainer_config_pb2
from protos.exposure import Gap, exposure_gaps
from protos.rules import check, check_ranges

# #14: the post-training kinds (trainer/rl/, docs/rlhf.md).
RL_KINDS = (job_pb2.REWARD, job_pb2.DPO, job_pb2.PPO)
# The kinds that run the one training loop (trainer/loop.py; trainer/jobs' registry maps each
# to trainer/jobs/train.py): what a training-only field (trainer.profile) applies to.
TRAINING_KINDS = (
    job_pb2.PRETRAIN, job_pb2.SFT, job_pb2.VLM, *RL_KINDS, job_pb2.DISTILL
)  # fmt: skip


def validate_rl(cfg: trainer_config_pb2.TrainerConfig, kind: job_pb2.JobKind) -> None:
    """The rules of a REWARD, DPO or PPO job (trainer.rl and what it needs elsewhere)."""
    rl, name = cfg.rl, job_pb2.JobKind.Name(kind)
    check_ranges(rl, "rl", "trainer.rl")
    check(
        bool(cfg.checkpoint.path),
        "trainer.checkpoint.path",
        f"{name} starts from a trained checkpoint (an SFT or pretrain run's step_* directory)",
    )
    if kind in (job_pb2.REWARD, job_pb2.DPO):
        check(bool(rl.preferences), "trainer.rl.preferences", f"{name} needs preference pairs")
    if kind == job_pb2.PPO:
        check(bool(rl.prompts), "trainer.rl.prompts", "PPO needs a JSONL file of prompts")
        check(
            rl.reward != trainer_config_pb2.REWARD_MODEL or bool(rl.reward_path),
            "trainer.rl.reward_path",
            "reward REWARD_MODEL needs a REWARD job's checkpoint (or choose a verifier)",
        )
        check(
            rl.algorithm != trainer_config_pb2.GRPO or rl.group_size >= 2,
            "trainer.rl.group_size",
            f"{rl.group_size}: GRPO normalizes rewards within a group, it needs at least 2",
        )


def validate_distill(cfg: trainer_config_pb2.TrainerConfig) -> None:
    """#30: a DISTILL job names its teacher and trains on text."""
    check_ranges(cfg.distill, "distill", "trainer.distill")
    check(
        bool(cfg.distill.teacher_path),
        "trainer.distill.teacher_path",
        "DISTILL learns from a teacher: name its checkpoint (a step_* directory)",
    )
    check(
        cfg.data.format not in IMAGE_FORMATS,
        "trainer.data.format",
        f"{enums.enum_name(cfg.data, 'format')} holds images: DISTILL trains on text",
    )


# #16: the data formats that hold images (read by trainer/data/images.py)
IMAGE_FORMATS = (trainer_config_pb2.JSONL_IMAGE, trainer_config_pb2.IMAGE_DIR)


def validate_vision(cfg: trainer_config_pb2.TrainerConfig, kind: job_pb2.JobKind) -> None:
    """#16: the vision section, and which jobs read images."""
    v, fmt = cfg.vision, cfg.data.format
    check_ranges(v, "vision", "trainer.vision")
    if kind == job_pb2.VLM:
        check(
            fmt in IMAGE_FORMATS,
            "trainer.data.format",
            "a VLM trains on images: use JSONL_IMAGE or IMAGE_DIR, not "
            + enums.enum_name(cfg.data, "format"),
        )
    if kind in (job_pb2.PRETRAIN, job_pb2.SFT):
        check(
            fmt not in IMAGE_FORMATS,
            "trainer.data.format",
            f"{enums.enum_name(cfg.data, 'format')} holds images: train them with kind VLM",
        )
    check(
        v.image_size % v.patch_size == 0,
        "trainer.vision.patch_size",
        f"{v.patch_size} does not divide image_size {v.image_size}",
    )
    grid = v.image_size // v.patch_size
    check(
        grid % v.pixel_shuffle == 0,
        "trainer.vision.pixel_shuffle",
        f"{v.pixel_shuffle} does not divide the {grid} x {grid} patch grid",
    )
    check(
        v.dim % v.n_heads == 0, "trainer.vision.n_heads", f"{v.n_heads} does not divide dim {v.dim}"
    )


def validate_serve(cfg: trainer_config_pb2.TrainerConfig) -> None:
    """#15: the KV-cache pool can hold one request of the model's full length (the config's
    here; the serve job checks its checkpoint's again at start-up: `check_serve_pool`). #31: the
    endpoint's exposure follows the launcher's rule (protos/exposure.py), its API key comes from
    one place, and TLS has both halves."""
    s = cfg.serve
    check_ranges(s, "serve", "trainer.serve")
    check_serve_pool(s, cfg.model.max_seq_len, "model.max_seq_len")
    check(
        not s.draft_path or s.speculative_tokens > 0,
        "trainer.serve.draft_path",
        "a draft model drafts serve.speculative_tokens tokens a step: set it (e.g. 4)",
    )
    check(
        not (s.api_key_file and s.api_key_env),
        "trainer.serve.api_key_env",
        "set api_key_file or api_key_env, not both",
    )
    check(
        bool(s.tls_cert) == bool(s.tls_key),
        "trainer.serve.tls_key" if s.tls_cert else "trainer.serve.tls_cert",
        "tls_cert and tls_key go together",
    )
    host = s.host or "127.0.0.1"
    gaps = exposure_gaps(
        host,
        tls=bool(s.tls_cert),
        auth=bool(s.api_key_file or s.api_key_env),
        allow_plaintext=s.allow_plaintext,
        allow_unauthenticated=s.allow_unauthenticated,
    )
    check(
        Gap.PLAINTEXT not in gaps,
        "trainer.serve.host",
        f"{host} is reachable from other machines, and without TLS the API key and every "
        "prompt travel in clear: set serve.tls_cert and serve.tls_key, or "
        "serve.allow_plaintext: true on a trusted network",
    )
    check(
        Gap.UNAUTHENTICATED not in gaps,
        "trainer.serve.host",
        f"{host} is reachable from other machines, and without an API key anyone there can "
        "use the model: set serve.api_key_file (or serve.api_key_env), or "
        "serve.allow_unauthenticated: true on a trusted network",
    )


def check_serve_pool(s: trainer_config_pb2.ServeConfig, max_len: int, source: str) -> None:
    """The pool of `s` holds one request of `max_len` positions (`source`: where that length
    comes from); else a request of the model's full context could never finish (#36)."""
    check(
        s.num_blocks * s.block_size >= max_len,
        "trainer.serve.num_blocks",
        f"{s.num_blocks} blocks of {s.block_size} tokens cannot hold one request of "
        f"{source} {max_len} tokens: a request could never finish",
    )
