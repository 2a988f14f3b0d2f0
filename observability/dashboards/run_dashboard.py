"""The run dashboard: is this training job healthy? One job or several, picked with $job_id."""

from grafana_foundation_sdk.builders import dashboard, stat
from grafana_foundation_sdk.models.dashboard import Dashboard

from observability.dashboards import health_panels
from observability.dashboards.panels import (
    kitchen_dashboard,
    multi_value_variable,
    stat_panel,
    target,
    timeseries_panel,
)

UID = "kitchen-run"
JOB = 'job_id=~"$job_id"'
LEGEND = "{{name}} ({{job_id}})"


def _series(metric: str) -> str:
    return f"{metric}{{{JOB}}}"


LOSS = _series("kitchen_train_loss")
MFU = _series("job_id:kitchen_train_mfu_ratio:avg1m")
TOKENS = _series("job_id:kitchen_train_tokens:rate1m")
P50 = _series("job_id:kitchen_train_step_duration_seconds:p50_1m")
P99 = _series("job_id:kitchen_train_step_duration_seconds:p99_1m")
GOODPUT = _series("kitchen_train_goodput_ratio")
MEMORY = _series("kitchen_train_peak_memory_bytes")
RESTARTS = _series("kitchen_job_attempts_total") + " - 1"
PROGRESS = _series("kitchen_train_step") + " / " + _series("kitchen_train_total_steps")


def _glance(title: str, description: str, unit: str, expr: str) -> stat.Panel:
    return stat_panel(title, description, unit, expr, LEGEND, width=3)


def build() -> Dashboard:
    return (
        kitchen_dashboard(
            UID,
            "Kitchen run",
            "One training run: loss, MFU, throughput, step time, goodput, memory, restarts, "
            "experts. "
            "Guide: docs/observability.md",
        )
        .with_variable(
            multi_value_variable("job_id", "Job", "label_values(kitchen_train_loss, job_id)")
        )
        .with_row(dashboard.Row("At a glance"))
        .with_panel(
            _glance(
                "Progress", "Latest step over the steps the job will run.", "percentunit", PROGRESS
            )
        )
        .with_panel(_glance("Loss", "Training loss at the latest report.", "none", LOSS))
        .with_panel(_glance("MFU", "Model FLOPs utilization, 1-minute mean.", "percentunit", MFU))
        .with_panel(
            _glance("Tokens/s", "Training tokens per second, 1-minute rate.", "short", TOKENS)
        )
        .with_panel(_glance("Step time p50", "Median step time over the last minute.", "s", P50))
        .with_panel(
            _glance(
                "Goodput", "Share of wall time spent on steps that count.", "percentunit", GOODPUT
            )
        )
        .with_panel(_glance("Peak memory", "Peak accelerator memory.", "bytes", MEMORY))
        .with_panel(
            _glance("Restarts", "Attempts after the first, preemptions included.", "none", RESTARTS)
        )
        .with_row(dashboard.Row("Training"))
        .with_panel(
            timeseries_panel(
                "Loss",
                "Training loss at each report, and evaluation loss when the job evaluates. "
                "Healthy: falls fast, then slowly, with noise but no jumps; eval loss follows "
                "train loss. NaN, or a jump that stays: divergence. Eval rising while train "
                "falls: over-fitting.",
                "none",
                [
                    target(LOSS, "train " + LEGEND, "A"),
                    target(_series("kitchen_train_eval_loss"), "eval " + LEGEND, "B"),
                ],
            )
        )
        .with_panel(
            timeseries_panel(
                "MFU",
                "Model FLOPs utilization: achieved training FLOP/s over the accelerator's peak. "
                "Healthy: flat after warm-up (30-50% for large dense models on H100). A sag "
                "means a slow node, throttling or input stalls.",
                "percentunit",
                [target(MFU, LEGEND)],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Throughput",
                "Training tokens per second, from the token counter (restarts do not reset it).",
                "short",
                [target(TOKENS, LEGEND)],
                axis_label="tokens/s",
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Step time p50 / p99",
                "Step time quantiles over the last minute. p99 far above p50 every few minutes "
                "is checkpointing (a sawtooth); p50 rising is a straggler or a slow input.",
                "s",
                [target(P50, "p50 " + LEGEND, "A"), target(P99, "p99 " + LEGEND, "B")],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Goodput",
                "Productive training time over wall time since the job started. Restarts, "
                "rollbacks, checkpoint stalls and data stalls lower it. Healthy: above 90%.",
                "percentunit",
                [target(GOODPUT, LEGEND)],
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            timeseries_panel(
                "Restarts and preemptions",
                "Attempts after the first (crashes, hangs, node loss and preemptions; each "
                "resumes from the last checkpoint) and, of those, preemptions, which are not "
                "failures.",
                "none",
                [
                    target(RESTARTS, "restarts " + LEGEND, "A"),
                    target(_series("kitchen_job_preemptions_total"), "preemptions " + LEGEND, "B"),
                ],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Eval scores",
                "Scores of eval jobs (held-out loss, lm-evaluation-harness tasks), one series "
                "per task, metric and checkpoint step: a sweep over a run's checkpoints draws "
                "one line per step. Did the model get better? Later steps score higher "
                "(accuracy) or lower (loss, perplexity). Guide: docs/eval.md",
                "none",
                [target(_series("kitchen_eval_score"), "{{task}} {{metric}} step {{step}}")],
            )
        )
        .with_row(dashboard.Row("Memory, data and optimizer"))
        .with_panel(
            timeseries_panel(
                "Peak memory",
                "Peak accelerator memory of the job. Close to the device's capacity: the next "
                "longer batch may run out of memory.",
                "bytes",
                [target(MEMORY, LEGEND)],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Padding fraction",
                "Share of tokens in each batch that are padding: compute spent on nothing. "
                "Packing keeps pretraining near 0; SFT with short examples pads more.",
                "percentunit",
                [target(_series("kitchen_train_padding_ratio"), LEGEND)],
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(  # #16
            timeseries_panel(
                "Image-token share (VLM)",
                "Share of a VLM job's batch tokens that are image tokens (docs/vlm.md). Each "
                "also cost the vision encoder's FLOPs, so a rising share makes steps slower at "
                "the same token count; pixel_shuffle divides it. Text jobs stay at 0.",
                "percentunit",
                [target(_series("kitchen_train_image_token_share_ratio"), LEGEND)],
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            timeseries_panel(
                "Gradient norm",
                "Gradient norm before clipping. Spikes often come a few steps before a loss "
                "spike; a steady climb is an early sign of divergence.",
                "none",
                [target(_series("kitchen_train_grad_norm"), LEGEND)],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Learning rate",
                "The schedule as the trainer applies it: warm-up, then decay.",
                "none",
                [target(_series("kitchen_train_learning_rate"), LEGEND)],
                min_value=0,
            )
        )
        .with_row(dashboard.Row("Health by rank"))
        .with_panel(health_panels.straggler_scores(JOB))
        .with_panel(health_panels.collective_wait(JOB))
        .with_panel(health_panels.silent_data_corruption(JOB))
        # #14: REWARD, DPO and PPO jobs (docs/rlhf.md); empty for other kinds.
        .with_row(dashboard.Row("RL (reward model, DPO, PPO/GRPO)"))
        .with_panel(
            timeseries_panel(
                "Reward and verifier pass rate",
                "PPO: mean reward of each rollout batch; DPO and PPO: the verifier's pass rate on "
                "held-out prompts. Healthy: both rise together. Reward rising while the pass rate "
                "does not, or while KL (next panel) climbs fast, is reward hacking.",
                "none",
                [
                    target(_series("kitchen_rl_reward_mean"), "reward " + LEGEND, "A"),
                    target(_series("kitchen_rl_pass_rate_ratio"), "pass rate " + LEGEND, "B"),
                ],
            )
        )
        .with_panel(
            timeseries_panel(
                "KL to the reference",
                "Mean per-response KL(policy || reference) in nats. Healthy: rises, then levels "
                "off. A steep climb (alert KitchenRLKLBlowUp) with degenerate responses: the KL "
                "penalty (rl.kl_coef, rl.beta) is too weak.",
                "none",
                [target(_series("kitchen_rl_kl"), LEGEND)],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "PPO step: generating vs updating",
                "Seconds of each PPO step spent sampling and scoring rollouts, and in the "
                "optimizer epochs. RL is generation-bound: when rollouts dominate, batch more "
                "prompts per rollout before buying faster optimizers.",
                "s",
                [
                    target(_series("kitchen_rl_rollout_seconds"), "rollout " + LEGEND, "A"),
                    target(_series("kitchen_rl_update_seconds"), "update " + LEGEND, "B"),
                ],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Entropy, clip fraction, response length",
                "PPO: per-token entropy of the policy's samples (collapsing to 0: the policy "
                "repeats itself), the share of tokens whose ratio was clipped (above ~0.3: steps "
                "too large), and mean response length in tokens.",
                "none",
                [
                    target(_series("kitchen_rl_entropy"), "entropy " + LEGEND, "A"),
                    target(_series("kitchen_rl_clip_ratio"), "clip fraction " + LEGEND, "B"),
                    target(_series("kitchen_rl_response_length_tokens"), "length " + LEGEND, "C"),
                ],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Preference accuracy and margin",
                "REWARD and DPO: share of pairs whose chosen response scores above the rejected "
                "one (0.5 is chance), and the mean score margin. Held-out accuracy well above "
                "0.5 is what makes a reward model usable.",
                "none",
                [
                    target(
                        _series("kitchen_rl_preference_accuracy_ratio"), "accuracy " + LEGEND, "A"
                    ),
                    target(_series("kitchen_rl_margin"), "margin " + LEGEND, "B"),
                ],
            )
        )
        .with_row(dashboard.Row("Mixture of experts (empty for dense models)"))
        .with_panel(
            timeseries_panel(
                "Expert load imbalance per layer",
                "Max over mean tokens per expert, per MoE layer: 1 is even, experts/top_k is a "
                "router that sends everything to k experts. Balanced runs sit near 1.2-2; a "
                "climb that stays is router collapse (alert KitchenMoERouterCollapse, "
                "docs/moe.md).",
                "none",
                [target(_series("kitchen_train_moe_layer_imbalance"), "layer {{layer}} " + LEGEND)],
                min_value=1,
            )
        )
        .with_panel(
            timeseries_panel(
                "Load-balancing loss per layer",
                "E·sum_i f_i·P_i per MoE layer (Switch/GShard): 1 when tokens and router "
                "probability spread evenly, up to E when collapsed.",
                "none",
                [target(_series("kitchen_train_moe_layer_aux_loss"), "layer {{layer}} " + LEGEND)],
                min_value=0,
            )
        )
        .with_panel(
            timeseries_panel(
                "Router entropy and dropped tokens",
                "The lowest layer's mean router entropy over ln(experts) (1: the router cannot "
                "choose; near 0: certain) and the share of routed assignments dropped at expert "
                "capacity (0 when dropless).",
                "percentunit",
                [
                    target(
                        _series("kitchen_train_moe_min_router_entropy"), "entropy " + LEGEND, "A"
                    ),
                    target(_series("kitchen_train_moe_dropped_ratio"), "dropped " + LEGEND, "B"),
                ],
                min_value=0,
                max_value=1,
            )
        )
        .build()
    )
