"""The dashboard rows and panels that show catalog metrics (protos/metric_catalog.py).

A panel here is drawn by observability/dashboards/ with one target per catalog metric that names
it, in catalog order; panels whose queries are derived (recording rules, ratios of two series)
stay in the dashboard modules. Torch-free, like the catalog.
"""

import dataclasses
import enum


class Board(enum.Enum):
    """The Grafana dashboard a row belongs to (its uid)."""

    RUN = "kitchen-run"
    SERVE = "kitchen-serve"


@dataclasses.dataclass(frozen=True)
class Row:
    board: Board
    title: str


@dataclasses.dataclass(frozen=True)
class Panel:
    row: Row
    title: str
    unit: str  # Grafana's unit id: "none", "s", "bytes", "percentunit", "short"
    help: str  # the panel's description: what it shows, what healthy looks like
    min_value: float | None = None
    max_value: float | None = None


# Rows in the order their dashboard shows them.
RUN_GLANCE = Row(Board.RUN, "At a glance")
RUN_TRAINING = Row(Board.RUN, "Training")
RUN_MEMORY = Row(Board.RUN, "Memory, data and optimizer")
RUN_RANKS = Row(Board.RUN, "Health by rank")
RUN_RL = Row(Board.RUN, "RL (reward model, DPO, PPO/GRPO)")
RUN_MOE = Row(Board.RUN, "Mixture of experts (empty for dense models)")
SERVE_GLANCE = Row(Board.SERVE, "At a glance")
SERVE_LOAD = Row(Board.SERVE, "Latency and load")
ROWS = (
    RUN_GLANCE, RUN_TRAINING, RUN_MEMORY, RUN_RANKS, RUN_RL, RUN_MOE, SERVE_GLANCE, SERVE_LOAD,
)  # fmt: skip

LOSS = Panel(
    RUN_TRAINING,
    "Loss",
    "none",
    "Training loss at each report, and evaluation loss when the job evaluates. Healthy: falls "
    "fast, then slowly, with noise but no jumps; eval loss follows train loss. NaN, or a jump "
    "that stays: divergence. Eval rising while train falls: over-fitting.",
)
GOODPUT = Panel(
    RUN_TRAINING,
    "Goodput",
    "percentunit",
    "Productive training time over wall time since the job started. Restarts, rollbacks, "
    "checkpoint stalls and data stalls lower it. Healthy: above 90%.",
    0,
    1,
)
PEAK_MEMORY = Panel(
    RUN_MEMORY,
    "Peak memory",
    "bytes",
    "Peak accelerator memory of the job. Close to the device's capacity: the next longer batch "
    "may run out of memory.",
    0,
)
PADDING = Panel(
    RUN_MEMORY,
    "Padding fraction",
    "percentunit",
    "Share of tokens in each batch that are padding: compute spent on nothing. Packing keeps "
    "pretraining near 0; SFT with short examples pads more.",
    0,
    1,
)
IMAGE_TOKENS = Panel(
    RUN_MEMORY,
    "Image-token share (VLM)",
    "percentunit",
    "Share of a VLM job's batch tokens that are image tokens (docs/vlm.md). Each also cost the "
    "vision encoder's FLOPs, so a rising share makes steps slower at the same token count; "
    "pixel_shuffle divides it. Text jobs stay at 0.",
    0,
    1,
)
GRAD_NORM = Panel(
    RUN_MEMORY,
    "Gradient norm",
    "none",
    "Gradient norm before clipping. Spikes often come a few steps before a loss spike; a steady "
    "climb is an early sign of divergence.",
    0,
)
LEARNING_RATE = Panel(
    RUN_MEMORY,
    "Learning rate",
    "none",
    "The schedule as the trainer applies it: warm-up, then decay.",
    0,
)
STRAGGLERS = Panel(
    RUN_RANKS,
    "Straggler score by rank",
    "none",
    "Each rank's busy time (step time minus the time it waits on its peers) over the median "
    "rank's. Healthy: every rank near 1. One rank far above 1 while the others sit at or below "
    "it: that rank is the straggler, and everyone waits for it (KitchenStraggler fires above "
    "1.5 for 10 minutes).",
    0,
)
COLLECTIVE_WAIT = Panel(
    RUN_RANKS,
    "Collective wait by rank",
    "s",
    "Mean time per step each rank spends blocked in collectives, waiting for the others. A "
    "straggler shows the other way round: it waits least, all its peers wait most.",
    0,
)
SDC = Panel(
    RUN_RANKS,
    "Silent data corruption",
    "none",
    "Replica checks each rank lost (its parameters or optimizer state differed from the "
    "majority), and the job's rollbacks after them. Healthy: no series above 0. A rank above 0: "
    "suspect its host's hardware (KitchenSilentDataCorruption).",
    0,
)
REWARD = Panel(
    RUN_RL,
    "Reward and verifier pass rate",
    "none",
    "PPO: mean reward of each rollout batch; DPO and PPO: the verifier's pass rate on held-out "
    "prompts. Healthy: both rise together. Reward rising while the pass rate does not, or while "
    "KL (next panel) climbs fast, is reward hacking.",
)
KL = Panel(
    RUN_RL,
    "KL to the reference",
    "none",
    "Mean per-response KL(policy || reference) in nats. Healthy: rises, then levels off. A "
    "steep climb (alert KitchenRLKLBlowUp) with degenerate responses: the KL penalty "
    "(rl.kl_coef, rl.beta) is too weak.",
    0,
)
ROLLOUT_TIME = Panel(
    RUN_RL,
    "PPO rollout time",
    "s",
    "Seconds of each PPO step spent sampling and scoring rollouts; the whole step is on 'Step "
    "time p50 / p99'. RL is generation-bound: when rollouts are most of the step, batch more "
    "prompts per rollout before buying faster optimizers.",
    0,
)
LOGPROB_DIFF = Panel(
    RUN_RL,
    "Rollout vs trainer log-probabilities",
    "none",
    "PPO: the largest difference, in nats, between the log-probability the inference engine "
    "reported for a sampled token and the trainer's recomputation from the same weights. Kitchen "
    "samples with the trained model itself, so it is float rounding (about 1e-6 in fp32); a jump "
    "means the two paths compute different things and the policy gradient is off-policy.",
    0,
)
POLICY = Panel(
    RUN_RL,
    "Entropy, clip fraction, response length",
    "none",
    "PPO: per-token entropy of the policy's samples (collapsing to 0: the policy repeats "
    "itself), the share of tokens whose ratio was clipped (above ~0.3: steps too large), and "
    "mean response length in tokens.",
    0,
)
PREFERENCES = Panel(
    RUN_RL,
    "Preference accuracy and margin",
    "none",
    "REWARD and DPO: share of pairs whose chosen response scores above the rejected one (0.5 is "
    "chance), and the mean score margin. Held-out accuracy well above 0.5 is what makes a "
    "reward model usable.",
)
EXPERT_IMBALANCE = Panel(
    RUN_MOE,
    "Expert load imbalance per layer",
    "none",
    "Max over mean tokens per expert, per MoE layer: 1 is even, experts/top_k is a router that "
    "sends everything to k experts. Balanced runs sit near 1.2-2; a climb that stays is router "
    "collapse (alert KitchenMoERouterCollapse, docs/moe.md).",
    1,
)
AUX_LOSS = Panel(
    RUN_MOE,
    "Load-balancing loss per layer",
    "none",
    "E·sum_i f_i·P_i per MoE layer (Switch/GShard): 1 when tokens and router probability spread "
    "evenly, up to E when collapsed.",
    0,
)
ROUTER = Panel(
    RUN_MOE,
    "Router entropy and dropped tokens",
    "percentunit",
    "The lowest layer's mean router entropy over ln(experts) (1: the router cannot choose; near "
    "0: certain) and the share of routed assignments dropped at expert capacity (0 when "
    "dropless).",
    0,
    1,
)
TTFT = Panel(
    SERVE_LOAD,
    "Time to first token p50 / p99",
    "s",
    "From a request's arrival to its first token, over each heartbeat window. It grows with the "
    "queue (waiting) and with long prompts (prefill).",
    0,
)
ITL = Panel(
    SERVE_LOAD,
    "Inter-token latency p50 / p99",
    "s",
    "Between two tokens of one request: one engine step. It grows with the batch; p99 spikes "
    "are steps that also prefilled a prompt.",
    0,
)
REQUESTS = Panel(
    SERVE_LOAD,
    "Requests running / waiting",
    "none",
    "Running: in the continuous batch. Waiting: queued, or preempted and waiting to be "
    "recomputed. Waiting that keeps growing: more load than the job can serve.",
    0,
)
KV_BLOCKS = Panel(
    SERVE_LOAD,
    "KV-cache blocks used / free / shared",
    "none",
    "Paged KV-cache blocks. All used with requests waiting: the batch is bounded by memory; "
    "preemptions follow. Shared: held by more than one request (a common prefix read from the "
    "prefix cache); near 0 when requests share a system prompt means they differ before it.",
    0,
)
SERVE_TOKENS = Panel(
    SERVE_LOAD,
    "Generated tokens/s and preemptions",
    "short",
    "Throughput over each heartbeat window, and requests preempted so far (their blocks were "
    "taken back; they are recomputed, never dropped).",
    0,
)
