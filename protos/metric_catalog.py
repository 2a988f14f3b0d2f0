"""Every metric a trainer reports, declared once: its kitchen.v1.Progress field, its Prometheus
series, its help and unit, the job kinds that report it (the exporter writes a series for those
jobs only: a serve job has no zero training series, a training job no zero serve series), and
the dashboard panel that shows it.

launcher/metrics.py exports each entry and observability/dashboards/ draws each panel by looping
over CATALOG, so a new kind's new metric is its Progress field and one line here. A numeric field
that is not exported is listed in NOT_EXPORTED with the reason (metric_catalog_test.py checks
that every numeric field is one or the other). Torch-free: the launcher imports it.
"""

import dataclasses
import enum

from protos import job_pb2
from protos import metric_panels as panels


class Source(enum.Enum):
    """The message a field belongs to, and the labels its series add to the job's."""

    PROGRESS = "Progress"  # the job's labels
    RANK = "RankHealth"  # + rank, host: the latest Progress.ranks, at most RANK_SERIES_LIMIT
    MOE_LAYER = "MoeLayerStats"  # + layer: Progress.moe_layers of the latest MoE record


class Series(enum.Enum):
    """How reports become a series."""

    LATEST = enum.auto()  # gauge: the latest report's value
    NAN_UNTIL_REPORTED = enum.auto()  # gauge: NaN until a non-zero value came, then the latest
    NEWEST_NONZERO = enum.auto()  # gauge, once reported (train and eval records differ in fields)
    MOE = enum.auto()  # gauge: from the latest record with MoE statistics (eval records have none)
    COUNTER = enum.auto()  # counter (`_total`): an all-time count the trainer keeps
    STEP_HISTOGRAM = enum.auto()  # histogram: one observation per step since the last report


ANY = ()  # every kind
TRAINING = (
    job_pb2.PRETRAIN, job_pb2.SFT, job_pb2.VLM, job_pb2.REWARD, job_pb2.DPO, job_pb2.PPO,
    job_pb2.DISTILL,
)  # fmt: skip
PPO = (job_pb2.PPO,)  # PPO and GRPO
PAIRS = (job_pb2.REWARD, job_pb2.DPO)
SERVE = (job_pb2.SERVE,)


@dataclasses.dataclass(frozen=True)
class Metric:
    field: str  # of `source`
    name: str  # the Prometheus name (a counter's samples add `_total`)
    help: str  # with its unit
    kinds: tuple  # the job_pb2.JobKind values that report it (ANY: all); exported for those only
    series: Series = Series.LATEST
    panel: panels.Panel | None = None  # the run/serve dashboard panel that draws it
    legend: str = ""  # the panel legend's prefix ("train ", "p99 ")
    source: Source = Source.PROGRESS

    @property
    def sample(self) -> str:
        """The sample name a query selects."""
        return self.name + "_total" if self.series == Series.COUNTER else self.name


M, P = Metric, panels
_RANK, _LAYER = Source.RANK, Source.MOE_LAYER
_NZ = Series.NEWEST_NONZERO
CATALOG = (
    M("step", "kitchen_train_step", "Latest reported optimizer step (an eval job's: the "
      "checkpoint's).", (*TRAINING, job_pb2.EVAL)),
    M("total_steps", "kitchen_train_total_steps", "Steps the job will run.", TRAINING),
    M("loss", "kitchen_train_loss", "Training loss at the latest report.", TRAINING,
      panel=P.LOSS, legend="train "),
    M("eval_loss", "kitchen_train_eval_loss", "Latest evaluation loss (NaN before the first "
      "eval).", (*TRAINING, job_pb2.EVAL), Series.NAN_UNTIL_REPORTED, P.LOSS, "eval "),
    M("step_time_seconds", "kitchen_train_step_duration_seconds", "Wall time per optimizer step, "
      "seconds.", TRAINING, Series.STEP_HISTOGRAM),
    M("mfu", "kitchen_train_mfu_ratio", "Model FLOPs utilization, 0-1.", TRAINING),
    M("tokens_per_second", "kitchen_train_tokens_per_second", "Training throughput in tokens/s.",
      TRAINING),
    M("tokens_total", "kitchen_train_tokens", "Tokens trained on so far.", TRAINING,
      Series.COUNTER),
    M("goodput", "kitchen_train_goodput_ratio", "Share of wall time spent on useful steps, 0-1.",
      TRAINING, panel=P.GOODPUT),
    M("peak_memory_bytes", "kitchen_train_peak_memory_bytes", "Peak accelerator memory, bytes.",
      TRAINING, panel=P.PEAK_MEMORY),
    M("padding_fraction", "kitchen_train_padding_ratio", "Share of batch tokens that are "
      "padding, 0-1.", TRAINING, panel=P.PADDING),
    M("image_token_share", "kitchen_train_image_token_share_ratio", "VLM: image tokens / all "
      "tokens, 0-1.", (job_pb2.VLM,), panel=P.IMAGE_TOKENS),
    M("grad_norm", "kitchen_train_grad_norm", "Gradient norm before clipping.", TRAINING,
      panel=P.GRAD_NORM),
    M("lr", "kitchen_train_learning_rate", "Learning rate.", TRAINING, panel=P.LEARNING_RATE),
    M("comm_fraction", "kitchen_train_comm_ratio", "Share of a step spent in collectives, 0-1.",
      TRAINING),
    # Training health (#22): per rank, and the job's rollbacks after a failed replica check.
    M("step_time_seconds", "kitchen_train_rank_step_seconds", "Mean step time of one rank, "
      "seconds.", TRAINING, source=_RANK),
    M("data_time_seconds", "kitchen_train_rank_data_seconds", "Mean data time of one rank, "
      "seconds.", TRAINING, source=_RANK),
    M("straggler_score", "kitchen_train_rank_straggler_score", "A rank's busy time (step minus "
      "collective wait) over the median rank's.", TRAINING, panel=P.STRAGGLERS, source=_RANK),
    M("collective_wait_seconds", "kitchen_train_rank_collective_wait_seconds", "Mean time per "
      "step one rank waits in collectives for its peers, seconds.", TRAINING,
      panel=P.COLLECTIVE_WAIT, source=_RANK),
    M("sdc_mismatches", "kitchen_train_rank_sdc_mismatches", "Cross-replica checks a rank lost "
      "(its parameters or optimizer state differed).", TRAINING, panel=P.SDC,
      legend="lost checks ", source=_RANK),
    M("sdc_rollbacks", "kitchen_train_sdc_rollbacks", "Rollbacks after data-parallel replicas "
      "disagreed (silent data corruption).", TRAINING, Series.COUNTER, P.SDC, "rollbacks "),
    # #14 RLHF: train and eval records carry different ones, so each keeps its newest value.
    M("reward_mean", "kitchen_rl_reward_mean", "PPO: mean reward of the latest rollout batch.",
      PPO, _NZ, P.REWARD, "reward "),
    M("pass_rate", "kitchen_rl_pass_rate_ratio", "Verifier pass rate on held-out prompts, 0-1.",
      (job_pb2.DPO, job_pb2.PPO), _NZ, P.REWARD, "pass rate "),
    M("reward_std", "kitchen_rl_reward_std", "PPO: reward standard deviation in that batch.",
      PPO, _NZ),
    M("kl", "kitchen_rl_kl", "Mean per-response KL(policy || reference), nats.",
      (job_pb2.DPO, job_pb2.PPO), _NZ, P.KL),
    M("rollout_seconds", "kitchen_rl_rollout_seconds", "PPO: generating a step's rollouts, "
      "seconds.", PPO, _NZ, P.ROLLOUT_TIME),
    M("entropy", "kitchen_rl_entropy", "PPO: mean per-token entropy of the policy's samples, "
      "nats.", PPO, _NZ, P.POLICY, "entropy "),
    M("clip_fraction", "kitchen_rl_clip_ratio", "PPO: share of tokens whose ratio was clipped, "
      "0-1.", PPO, _NZ, P.POLICY, "clip fraction "),
    M("response_length", "kitchen_rl_response_length_tokens", "Mean response length, tokens.",
      PPO, _NZ, P.POLICY, "length "),
    M("value_loss", "kitchen_rl_value_loss", "PPO: value head loss.", PPO, _NZ),
    M("rollout_logprob_diff", "kitchen_rl_rollout_logprob_diff", "PPO: largest |engine - "
      "trainer| log-probability of a rollout token, nats.", PPO, _NZ, P.LOGPROB_DIFF),
    M("preference_accuracy", "kitchen_rl_preference_accuracy_ratio", "Chosen scored above "
      "rejected, 0-1.", PAIRS, _NZ, P.PREFERENCES, "accuracy "),
    M("margin", "kitchen_rl_margin", "Mean chosen minus rejected score.", PAIRS, _NZ,
      P.PREFERENCES, "margin "),
    M("chosen_reward", "kitchen_rl_chosen_reward", "DPO: implicit reward of chosen responses.",
      (job_pb2.DPO,), _NZ),
    M("rejected_reward", "kitchen_rl_rejected_reward", "DPO: implicit reward of rejected "
      "responses.", (job_pb2.DPO,), _NZ),
    # Mixture of experts (#18), over all ranks since the previous MoE record.
    M("imbalance", "kitchen_train_moe_layer_imbalance", "Max/mean tokens per expert, per layer.",
      TRAINING, Series.MOE, P.EXPERT_IMBALANCE, source=_LAYER),
    M("aux_loss", "kitchen_train_moe_layer_aux_loss", "Load-balancing loss E·sum f·P (1 = "
      "even).", TRAINING, Series.MOE, P.AUX_LOSS, source=_LAYER),
    M("moe_max_imbalance", "kitchen_train_moe_max_imbalance", "Worst MoE layer's max/mean "
      "tokens per expert (1 = even; experts/top_k = collapsed).", TRAINING, Series.MOE),
    M("moe_min_router_entropy", "kitchen_train_moe_min_router_entropy", "Lowest MoE layer's "
      "mean router entropy over ln(experts), 0-1.", TRAINING, Series.MOE, P.ROUTER, "entropy "),
    M("moe_dropped_fraction", "kitchen_train_moe_dropped_ratio", "Share of routed assignments "
      "dropped at expert capacity, 0-1.", TRAINING, Series.MOE, P.ROUTER, "dropped "),
    # A serve job's heartbeat (trainer/serve/); its latency histograms are on its own /metrics.
    M("ttft_p50_seconds", "kitchen_serve_ttft_p50_seconds", "Time to first token, median, "
      "seconds.", SERVE, panel=P.TTFT, legend="p50 "),
    M("ttft_p99_seconds", "kitchen_serve_ttft_p99_seconds", "Time to first token, p99, seconds.",
      SERVE, panel=P.TTFT, legend="p99 "),
    M("itl_p50_seconds", "kitchen_serve_itl_p50_seconds", "Inter-token latency, median, "
      "seconds.", SERVE, panel=P.ITL, legend="p50 "),
    M("itl_p99_seconds", "kitchen_serve_itl_p99_seconds", "Inter-token latency, p99, seconds.",
      SERVE, panel=P.ITL, legend="p99 "),
    M("running_requests", "kitchen_serve_running_requests", "Requests in a serve job's batch.",
      SERVE, panel=P.REQUESTS, legend="running "),
    M("waiting_requests", "kitchen_serve_waiting_requests", "Requests queued in a serve job.",
      SERVE, panel=P.REQUESTS, legend="waiting "),
    M("kv_blocks_used", "kitchen_serve_kv_blocks_used", "Paged KV-cache blocks in use.", SERVE,
      panel=P.KV_BLOCKS, legend="used "),
    M("kv_blocks_free", "kitchen_serve_kv_blocks_free", "Paged KV-cache blocks free.", SERVE,
      panel=P.KV_BLOCKS, legend="free "),
    M("generated_tokens_per_second", "kitchen_serve_generated_tokens_per_second", "Tokens a "
      "serve job generated per second.", SERVE, panel=P.SERVE_TOKENS, legend="tokens/s "),
    M("serve_preemptions", "kitchen_serve_job_preemptions", "Requests preempted for KV blocks.",
      SERVE, panel=P.SERVE_TOKENS, legend="preemptions "),
    M("kv_blocks_shared", "kitchen_serve_kv_blocks_shared", "Paged KV-cache blocks held by more "
      "than one request (shared prefixes).", SERVE, panel=P.KV_BLOCKS, legend="shared "),
    M("prompt_tokens", "kitchen_serve_job_prompt_tokens", "Prompt tokens a serve job admitted.",
      SERVE, Series.COUNTER),
    M("prefix_cached_tokens", "kitchen_serve_job_prefix_cached_tokens", "Prompt tokens read "
      "from the prefix cache instead of computed (hit rate: over prompt tokens).", SERVE,
      Series.COUNTER),
    M("spec_draft_tokens", "kitchen_serve_job_spec_draft_tokens", "Tokens speculative "
      "decoding's draft proposed.", SERVE, Series.COUNTER),
    M("spec_accepted_tokens", "kitchen_serve_job_spec_accepted_tokens", "Draft tokens the "
      "model confirmed (acceptance rate: over draft tokens).", SERVE, Series.COUNTER),
    M("grammar_seconds", "kitchen_serve_job_grammar_seconds", "Seconds structured output's "
      "grammars took (time per token: over grammar tokens).", SERVE, Series.COUNTER),
    M("grammar_tokens", "kitchen_serve_job_grammar_tokens", "Positions structured output's "
      "grammars masked.", SERVE, Series.COUNTER),
)  # fmt: skip

# Numeric fields deliberately not exported, and why: (source, field) -> reason.
NOT_EXPORTED = {
    (Source.PROGRESS, "attempt"): "the launcher counts attempts itself (kitchen_job_attempts)",
    (Source.PROGRESS, "rank"): "the reporting process, a label of RankHealth's series",
    (Source.PROGRESS, "data_time_seconds"): "exported per rank (kitchen_train_rank_data_seconds)",
    (Source.PROGRESS, "tflops"): "kitchen_train_mfu_ratio carries it over the accelerator's peak",
    (Source.PROGRESS, "skipped_steps"): "in the run's log and `kitchen report`; not exported yet",
    (Source.PROGRESS, "rollbacks"): "in the run's log and `kitchen report`, not yet exported",
    (Source.PROGRESS, "gradient_noise_scale"): "in the run's log, for batch-size studies",
    (Source.PROGRESS, "update_seconds"): "no longer reported: PPO's steps are optimizer steps "
    "since the recipes (#30); the whole step is kitchen_train_step_duration_seconds",
    (Source.PROGRESS, "sdc_checks"): "in the run's log; the failures are exported",
    (Source.PROGRESS, "precook_tasks_done"): "the launcher counts a PRECOOK job's task files",
    (Source.PROGRESS, "precook_tasks_total"): "the launcher counts a PRECOOK job's task files",
    (Source.PROGRESS, "requests_finished"): "the live view shows it; so does the job's /metrics",
    (Source.RANK, "rank"): "the `rank` label",
    (Source.MOE_LAYER, "layer"): "the `layer` label",
    (Source.MOE_LAYER, "dropped_fraction"): "the job-wide kitchen_train_moe_dropped_ratio",
    (Source.MOE_LAYER, "z_loss"): "in the run's log; the aux loss and imbalance show collapse",
    (Source.MOE_LAYER, "router_entropy"): "the job-wide kitchen_train_moe_min_router_entropy",
    (Source.MOE_LAYER, "micro_batch_imbalance"): "in the run's log (metrics.jsonl)",
}


def metrics(source: Source, series: Series | None = None) -> list[Metric]:
    """The catalog's metrics of one message (and one kind of series), in catalog order."""
    return [m for m in CATALOG if m.source == source and series in (None, m.series)]


def metric(field: str, source: Source = Source.PROGRESS) -> Metric:
    """The catalog entry of `field` (a KeyError names a field the catalog lacks)."""
    for m in CATALOG:
        if m.field == field and m.source == source:
            return m
    raise KeyError(f"{source.value}.{field} is not in protos/metric_catalog.py")


def panel_metrics(panel: panels.Panel) -> list[Metric]:
    """The metrics one panel draws, one target each, in catalog order."""
    return [m for m in CATALOG if m.panel == panel]
