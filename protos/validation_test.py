"""One validation for submit and the trainer: total over every field, errors name the field."""

import math

import pytest
from google.protobuf import json_format

from protos import job_pb2, trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.validation import resolve_data, resolve_trainer, validate_job_spec
from protos.validation_testing import error, spec_with


def test_a_minimal_spec_resolves_with_defaults():
    cfg = validate_job_spec(spec_with())
    assert (cfg.model.dim, cfg.train.steps, cfg.data.seq_len) == (256, 200, 256)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"trainer__model__n_heads": 6}, "trainer.model.n_heads: 6 does not divide dim 256"),
        (
            {"trainer__model__n_kv_heads": 3},
            "trainer.model.n_kv_heads: 3 does not divide n_heads 8",
        ),
        (
            {"trainer__data__seq_len": 512, "trainer__model__max_seq_len": 256},
            "trainer.data.seq_len: 512 is longer than the model's positions",
        ),
        ({"trainer__model__dim": 40}, "trainer.model.head_dim: 5 (n_heads 8 on dim 40)"),
        (
            {"trainer__model__n_heads": 6, "trainer__model__head_dim": 41},
            "trainer.model.head_dim: 41 (n_heads 6 on dim 256): rotary positions need it even",
        ),
        ({"trainer__model__head_dim": 1}, "trainer.model.head_dim: 1 is not in [2, 65,536]"),
        ({"trainer__model__n_layers": 0}, "trainer.model.n_layers: 0 is not in [1, 1,024]"),
        (
            {"trainer__model__n_layers": 2**31 - 1},
            "trainer.model.n_layers: 2,147,483,647 is not in [1, 1,024]",
        ),
        ({"trainer__data__seq_len": 1}, "trainer.data.seq_len: 1 is not in [2, "),
        ({"trainer__data__vocab_size": 100}, "trainer.data.vocab_size: 100 cannot fit"),
        ({"trainer__optim__lr": -1.0}, "trainer.optim.lr: -1 is not in (0, 10]"),
        ({"trainer__optim__lr": math.nan}, "trainer.optim.lr: nan is not a finite number"),
        ({"trainer__optim__beta2": 1.0}, "trainer.optim.beta2: 1 is not in [0, 1)"),
        ({"trainer__train__dtype": "fp4"}, "trainer.train.dtype: 'fp4'"),
        ({"trainer__hf__dtype": "fp8"}, "trainer.hf.dtype: 'fp8' is not one of fp32, bf16"),
        ({"trainer__train__micro_batch": 0}, "trainer.train.micro_batch"),
        ({"trainer__train__steps": 2**31 - 1}, "trainer.train.steps"),
        ({"trainer__train__spike_factor": 0.5}, "trainer.train.spike_factor"),
        ({"trainer__checkpoint__keep_last": 0}, "trainer.checkpoint.keep_last"),
        ({"trainer__generate__top_p": 0.0}, "trainer.generate.top_p"),
        ({"trainer__data__workers": 0}, "trainer.data.workers"),
        ({"trainer__data__eval_fraction": 1.0}, "trainer.data.eval_fraction: 1 is not in [0, 1)"),
        ({"trainer__data__tokenizer": trainer_config_pb2.BPE_FILE}, "trainer.data.tokenizer_path"),
        ({"name": ""}, "name: a job needs a name"),
        ({"name": "a b"}, "name: 'a b': use letters"),
        ({"name": "trailing\n"}, "name: 'trailing\\n': use letters"),
        ({"name": "x" * 1_000_000}, "name: 1,000,000 characters"),
        ({"team": "../etc"}, "team: '../etc'"),
        ({"kind": job_pb2.JOB_KIND_UNSPECIFIED}, "kind: a job needs a kind: one of PRECOOK"),
        ({"kind": 99}, "kind: 99 is not a value of JobKind"),
        ({"priority": 10**6}, "priority: 1,000,000 is not in [-1,000, 1,000]"),
        ({"retry__backoff_seconds": math.nan}, "retry.backoff_seconds: nan is not a finite"),
        ({"retry__backoff_seconds": 1e12}, "retry.backoff_seconds: 1e+12 is not in [0, 86400]"),
        ({"retry__max_attempts": -1}, "retry.max_attempts: -1 is not in [0, 100]"),
        ({"hang_timeout_seconds": math.nan}, "hang_timeout_seconds: nan is not a finite"),
        ({"hang_timeout_seconds": -5.0}, "hang_timeout_seconds: -5 is not in"),
        ({"resources__processes_per_node": 2**31 - 1}, "resources.processes_per_node"),
        ({"resources__nodes": -1}, "resources.nodes: -1 is not in"),
        ({"trainer__data__packing": 42}, "trainer.data.packing: 42 is not a value of Packing"),
        ({"trainer__data__input": "a\x00b"}, "trainer.data.input: contains a NUL"),
    ],
)
def test_bad_values_name_their_field(fields, message):
    assert error(spec_with(**fields)).startswith(message)


def test_several_processes_need_ddp_or_fsdp():
    spec = spec_with(trainer__train__parallelism=trainer_config_pb2.SINGLE)
    validate_job_spec(spec)
    spec.resources.processes_per_node = 2
    assert error(spec).startswith("trainer.train.parallelism: SINGLE with 2 processes")
    spec.trainer.train.parallelism = trainer_config_pb2.FSDP
    assert validate_job_spec(spec).train.parallelism == trainer_config_pb2.FSDP
    spec.trainer.train.ClearField("parallelism")  # unset: DDP when there are several
    assert validate_job_spec(spec).train.parallelism == trainer_config_pb2.DDP


def test_sft_needs_prompt_response_data():
    spec = spec_with(kind=job_pb2.SFT)
    assert error(spec).startswith("trainer.data.format: SFT trains on prompt/response pairs")
    spec.trainer.data.format = trainer_config_pb2.JSONL_CHAT
    assert validate_job_spec(spec).data.format == trainer_config_pb2.JSONL_CHAT


def test_unknown_wire_fields_are_refused_with_their_place():
    model = trainer_config_pb2.ModelConfig(dim=64).SerializeToString() + bytes([0xF8, 0x07, 1])
    spec = spec_with()
    spec.trainer.model.ParseFromString(model)  # field 127, varint: a newer client's field
    assert error(spec).startswith("trainer.model: unknown field number(s) 127")


def test_json_from_a_client_goes_through_the_same_rules():
    spec = json_format.Parse('{"name": "j", "kind": "EVAL", "retry": {"backoffSeconds": "NaN"}}',
                             job_pb2.JobSpec())  # fmt: skip
    assert error(spec).startswith("retry.backoff_seconds: nan")


def test_the_data_section_alone_names_data_fields():
    with pytest.raises(ConfigError, match=r"^data\.seq_len: 1 is not in"):
        resolve_data(trainer_config_pb2.DataConfig(seq_len=1))
    resolve_data(trainer_config_pb2.DataConfig(tokenizer=trainer_config_pb2.CL100K, vocab_size=10))
    chat = trainer_config_pb2.DataConfig(format=trainer_config_pb2.JSONL_CHAT)
    chat.prompt_field = chat.response_field = "x"
    with pytest.raises(ConfigError, match=r"^data\.response_field: is the same field"):
        resolve_data(chat)


def test_resolve_trainer_does_not_change_its_input():
    cfg = trainer_config_pb2.TrainerConfig()
    out = resolve_trainer(cfg)
    assert out.model.dim == 256 and not cfg.model.HasField("dim")


# #14: REWARD, DPO and PPO jobs.
@pytest.mark.parametrize(
    "kind, fields, message",
    [
        (job_pb2.DPO, {}, "trainer.checkpoint.path: DPO starts from a trained checkpoint"),
        (job_pb2.REWARD, {"trainer__checkpoint__path": "/c"}, "trainer.rl.preferences: REWARD"),
        (job_pb2.PPO, {"trainer__checkpoint__path": "/c"}, "trainer.rl.prompts: PPO needs"),
        (
            job_pb2.PPO,
            {"trainer__checkpoint__path": "/c", "trainer__rl__prompts": "/p"},
            "trainer.rl.reward_path: reward REWARD_MODEL needs a REWARD job's checkpoint",
        ),
        (
            job_pb2.PPO,
            {
                "trainer__checkpoint__path": "/c",
                "trainer__rl__prompts": "/p",
                "trainer__rl__reward": trainer_config_pb2.SENTENCE,
                "trainer__rl__algorithm": trainer_config_pb2.GRPO,
                "trainer__rl__group_size": 1,
            },
            "trainer.rl.group_size: 1: GRPO normalizes rewards within a group",
        ),
        (
            job_pb2.DPO,
            {
                "trainer__checkpoint__path": "/c",
                "trainer__rl__preferences": "/p",
                "trainer__rl__beta": 0.0,
            },
            "trainer.rl.beta: 0 is not in (0, 100]",
        ),
        (job_pb2.DISTILL, {}, "trainer.distill.teacher_path: DISTILL learns from a teacher"),
        (
            job_pb2.DISTILL,
            {"trainer__distill__teacher_path": "/t", "trainer__distill__alpha": 1.5},
            "trainer.distill.alpha: 1.5 is not in [0, 1]",
        ),
    ],
)
def test_rl_jobs_need_their_inputs(kind, fields, message):
    spec = spec_with(**fields)
    spec.kind = kind
    assert message in error(spec)


def test_post_training_kinds_run_on_several_processes():
    # #30: every training kind runs on the one core, under DDP or FSDP alike.
    spec = spec_with(
        trainer__checkpoint__path="/c",
        trainer__rl__preferences="/p",
        resources__processes_per_node=2,
    )
    spec.kind = job_pb2.DPO
    validate_job_spec(spec, world_size=2)


def test_an_rl_job_resolves_with_its_defaults():
    spec = spec_with(trainer__checkpoint__path="/c", trainer__rl__prompts="/p")
    spec.kind, spec.trainer.rl.reward = job_pb2.PPO, trainer_config_pb2.HAS_NUMBER
    rl = validate_job_spec(spec).rl
    assert (rl.beta, rl.group_size, rl.kl_coef, rl.max_new_tokens) == pytest.approx(
        (0.1, 4, 0.05, 24)
    )
    assert rl.algorithm == trainer_config_pb2.CLIPPED_PPO
    assert rl.pass_verifier == trainer_config_pb2.HAS_NUMBER  # derived from rl.reward


def test_head_dim_frees_the_heads_from_dividing_dim():
    """Qwen3-30B-A3B's attention: 32 heads of 128 on dim 2048; and heads that do not divide
    dim at all, once head_dim says how wide they are."""
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_heads = 2048, 32
    assert resolve_trainer(cfg).model.head_dim == 64  # derived: dim / n_heads
    cfg.model.head_dim = 128
    assert resolve_trainer(cfg).model.head_dim == 128
    cfg.model.n_heads, cfg.model.n_kv_heads = 6, 2
    assert resolve_trainer(cfg).model.head_dim == 128


@pytest.mark.parametrize(
    "fields, processes, message",
    [
        (
            {"moe_experts": 4, "moe_top_k": 5},
            1,
            "trainer.model.moe_top_k: 5 is more than moe_experts 4",
        ),
        (
            {"moe_experts": 4, "moe_every": 9},
            1,
            "trainer.model.moe_every: 9 is more than n_layers 4",
        ),
        (
            {"moe_experts": 4, "moe_every": 2, "moe_first_dense": 4},
            1,
            "trainer.model.moe_first_dense: 4 dense layers first leave no MoE layer of 4",
        ),
        ({"parallelism": "EXPERT"}, 2, "trainer.train.parallelism: EXPERT shards experts"),
        ({"moe_experts": 6, "parallelism": "EXPERT"}, 4, "4 ranks cannot share moe_experts 6"),
        (
            {"moe_experts": 8, "parallelism": "EXPERT", "expert_parallel": 3},
            4,
            "3 does not divide the 4",
        ),
        (
            {"moe_experts": 8, "expert_parallel": 2},
            1,
            "expert_parallel: only applies to parallelism EXPERT",
        ),
    ],
)
def test_moe_rules_name_their_field(fields, processes, message):
    cfg = trainer_config_pb2.TrainerConfig()
    for name, value in fields.items():
        section = cfg.train if name in ("parallelism", "expert_parallel") else cfg.model
        setattr(
            section, name, getattr(trainer_config_pb2, value) if isinstance(value, str) else value
        )
    with pytest.raises(ConfigError, match=message):
        resolve_trainer(cfg, world_size=processes)


def test_expert_parallel_over_all_processes_by_default():
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.moe_experts, cfg.train.parallelism = 8, trainer_config_pb2.EXPERT
    assert resolve_trainer(cfg, world_size=4).train.expert_parallel == 0  # 0 = all of them


@pytest.mark.parametrize(
    "sources, extra, field, problem",
    [
        ([{"name": "a", "input": "x"}], {"input": "y"}, "data.input", "must be empty"),
        ([{"name": "a b", "input": "x"}], {}, "data.sources[0].name", "use letters"),
        ([{"name": "a", "input": "x"}] * 2, {}, "data.sources[1].name", "names two sources"),
        ([{"name": "a"}], {}, "data.sources[0].input", "is required"),
        ([{"name": "a", "input": "x", "weight": -1}], {}, "data.sources[0].weight", "negative"),
        (
            [{"name": "a", "input": "x", "weight": 1, "token_budget": 5}],
            {},
            "data.sources[0].token_budget",
            "not both",
        ),
        (
            [{"name": "a", "input": "x", "format": trainer_config_pb2.JSONL_CHAT}],
            {},
            "data.sources[0].format",
            "JSONL_CHAT sources mix only with each other",
        ),
        ([], {"min_doc_tokens": 9, "max_doc_tokens": 8}, "data.max_doc_tokens", "below"),
        ([], {"near_dup_threshold": 1.5}, "data.near_dup_threshold", "not in [0, 1]"),
    ],
)
def test_mixture_sources_and_filters_name_the_field_at_fault(sources, extra, field, problem):
    data = trainer_config_pb2.DataConfig(**extra)
    for s in sources:
        data.sources.add(**s)
    with pytest.raises(ConfigError) as err:
        resolve_data(data)
    assert err.value.field == field and problem in err.value.problem, err.value


def test_interop_fields_are_checked():
    assert "trainer.hf.path: IMPORT reads a Hugging Face" in error(spec_with(kind=job_pb2.IMPORT))
    assert "trainer.eval.batch_size: 0 is not in [1," in error(
        spec_with(trainer__eval__batch_size=0)
    )
    cfg = validate_job_spec(spec_with(kind=job_pb2.EVAL))
    assert (cfg.eval.limit, cfg.eval.batch_size) == (0, 8)


def test_precook_tasks_are_for_a_precook_job_of_text():
    assert "trainer.data.tasks: 4 tasks: only a PRECOOK job" in error(
        spec_with(trainer__data__tasks=4)
    )
    precook = spec_with(kind=job_pb2.PRECOOK, trainer__data__tasks=4)
    assert validate_job_spec(precook).data.tasks == 4
    assert validate_job_spec(spec_with(kind=job_pb2.PRECOOK)).data.tasks == 1  # the default
    assert error(spec_with(kind=job_pb2.PRECOOK, trainer__data__tasks=0)).startswith(
        "trainer.data.tasks: 0 is not in"
    )


def serve_spec(**serve) -> job_pb2.JobSpec:
    spec = spec_with(kind=job_pb2.SERVE, trainer__checkpoint__path="/ckpt")
    for name, value in serve.items():
        setattr(spec.trainer.serve, name, value)
    return spec


@pytest.mark.parametrize(
    "serve, message",
    [
        # #31: the launcher's exposure rule (protos/exposure.py): off-loopback needs TLS...
        ({"host": "0.0.0.0", "api_key_file": "/k"}, "trainer.serve.host: 0.0.0.0 is reachable"),
        ({"host": "10.1.2.3", "api_key_env": "K"}, "serve.tls_cert and serve.tls_key"),
        # ...and an API key, each unless explicitly allowed
        ({"host": "0.0.0.0", "allow_plaintext": True}, "serve.api_key_file"),
        ({"host": "", "port": 1, "tls_cert": "/c"}, "trainer.serve.tls_key: tls_cert and"),
        ({"api_key_file": "/k", "api_key_env": "K"}, "trainer.serve.api_key_env: set api_key"),
        ({"max_stop": -1}, "trainer.serve.max_stop: -1 is not in [0, 1,024]"),
        ({"max_body_bytes": 10}, "trainer.serve.max_body_bytes: 10 is not in"),
        ({"request_timeout_seconds": math.nan}, "request_timeout_seconds: nan is not a finite"),
        # #35: a draft model with nothing to draft
        ({"draft_path": "/small"}, "trainer.serve.draft_path: a draft model drafts"),
        ({"speculative_tokens": 65}, "trainer.serve.speculative_tokens: 65 is not in"),
    ],
)
def test_serve_exposure_and_limits_are_checked(serve, message):
    assert message in error(serve_spec(**serve))


@pytest.mark.parametrize(
    "serve",
    [
        {},  # 127.0.0.1
        {"host": "::1"},
        {"host": "localhost"},
        {"host": "0.0.0.0", "allow_plaintext": True, "allow_unauthenticated": True},
        {"host": "0.0.0.0", "tls_cert": "/c", "tls_key": "/k", "api_key_file": "/key"},
        {"host": "0.0.0.0", "allow_plaintext": True, "api_key_env": "KITCHEN_SERVE_KEY"},
        {"draft_path": "/small", "speculative_tokens": 4},
    ],
)
def test_serve_exposure_that_is_allowed(serve):
    validate_job_spec(serve_spec(**serve))


@pytest.mark.parametrize(
    "kind, fields, message",
    [
        (job_pb2.PRETRAIN, {"steps": 1001}, "trainer.profile.steps: 1,001 is not in [0, 1,000]"),
        (job_pb2.PRETRAIN, {"steps": 2, "start_step": 0}, "trainer.profile.start_step: 0 is not"),
        (
            job_pb2.PRETRAIN,
            {"steps": 5, "start_step": 198},
            "trainer.profile.start_step: steps 198..202 end past the job's last step (train.steps"
            " 200)",
        ),
        (
            job_pb2.EVAL,
            {"steps": 2},
            "trainer.profile.steps: profiles training steps, and EVAL jobs take none",
        ),
    ],
)
def test_a_profile_names_its_field(kind, fields, message):
    spec = spec_with(kind=kind)
    for name, value in fields.items():
        setattr(spec.trainer.profile, name, value)
    assert error(spec).startswith(message)


def test_a_profile_defaults_off_and_fits_its_job():
    assert validate_job_spec(spec_with()).profile.steps == 0
    cfg = validate_job_spec(spec_with(trainer__profile__steps=3, trainer__train__steps=7))
    assert (cfg.profile.start_step, cfg.profile.steps, cfg.profile.top_ops) == (5, 3, 15)
