"""Who runs next, and what happens after an attempt ends: pure functions of state and a clock.

Rules (one pass, `plan`):
- Queued jobs go in priority order (higher first), first-in first-out within a priority.
- Gang admission: a job gets all of its nodes (each with its GPUs) in its pool, or nothing.
- A job that does not fit blocks the jobs behind it in the same pool (no backfill), so a big
  gang job is never starved by a stream of small ones. Jobs held back by their team's quota
  or by a retry backoff do not block anyone.
- A job that does not fit may preempt running jobs of strictly lower priority in its pool:
  the lowest priority first, the most recently started first, only as many as it needs, and
  only when stopping them makes it fit. While victims are stopping, nothing else is picked.
The launcher calls `plan` with `now` from its clock; tests call it with any `now` they like.

Cost: a pass sorts the queue by one integer per job (computed when the job is queued) and
applies the rules job by job only until every pool that still has queued jobs is blocked;
the jobs behind can then only wait, and get their reasons in one sweep. The plan is the same
as applying the rules to every job (`plan_job_by_job`; scheduler_test compares them).
"""

import collections
import dataclasses
import operator

from protos import job_pb2
from protos.exit_codes import ExitCode

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_BACKOFF_SECONDS = 5.0
DEFAULT_MAX_BACKOFF_SECONDS = 300.0
_SEQ_SPAN = 1 << 63  # a Demand's seq is a SQLite rowid: always below 2**63


@dataclasses.dataclass(frozen=True)
class Pool:
    name: str
    nodes: int
    gpus_per_node: int  # 0: a CPU pool, where a job takes whole nodes


@dataclasses.dataclass(frozen=True)
class Quota:
    max_nodes: int  # 0: no limit
    max_gpus: int


@dataclasses.dataclass(frozen=True, slots=True)
class Demand:
    """A queued job as the scheduler sees it."""

    job_id: str
    seq: int  # submission order
    priority: int
    pool: str
    team: str
    nodes: int
    gpus_per_node: int  # on a GPU pool, 0 means every GPU of the node
    not_before: float = 0.0  # retry backoff (epoch seconds)
    # Queue order (higher priority first, then seq) as one integer, computed once when the job
    # is queued: a pass sorts plain ints, ~4x faster than (priority, seq) tuples, and creates
    # no objects for the garbage collector to chase.
    order: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "order", -self.priority * _SEQ_SPAN + self.seq)


QUEUE_ORDER = operator.attrgetter("order")  # sort key of Demands: the queue's order
_POOL = operator.attrgetter("pool")


@dataclasses.dataclass(frozen=True)
class Holding:
    """A running job's resources: allocation is ((node, (gpu, ...)), ...)."""

    job_id: str
    priority: int
    pool: str
    team: str
    allocation: tuple
    started: float
    stopping: bool = False


@dataclasses.dataclass
class Plan:
    start: dict  # job_id -> allocation ((node, (gpu, ...)), ...)
    preempt: list  # job_ids of running jobs to stop
    waiting: dict  # job_id -> why it is not starting (for people)
    wake_at: float | None  # earliest retry backoff still running


class _Free:
    """Free capacity of one pool: per node, the free GPU indices (a CPU node has one slot)."""

    def __init__(self, pool: Pool, holdings):
        slots = pool.gpus_per_node or 1
        self.pool = pool
        self.free = [set(range(slots)) for _ in range(pool.nodes)]
        for h in holdings:
            self.release(h.allocation, sign=-1)

    def release(self, allocation, sign=1):
        for node, gpus in allocation:
            if node >= len(self.free):
                continue  # the pool shrank under a running job: its nodes are gone
            used = set(gpus) if self.pool.gpus_per_node else {0}
            self.free[node] = self.free[node] | used if sign > 0 else self.free[node] - used

    def fit(self, nodes: int, gpus: int):
        """An allocation of `nodes` nodes with `gpus` free GPUs each, or None (best fit)."""
        need = gpus if self.pool.gpus_per_node else 1
        fitting = [i for i, f in enumerate(self.free) if len(f) >= need]
        if len(fitting) < nodes:
            return None
        fitting.sort(key=lambda i: len(self.free[i]))  # fullest nodes first: less fragmentation
        chosen = sorted(fitting[:nodes])
        if not self.pool.gpus_per_node:
            return tuple((i, ()) for i in chosen)
        return tuple((i, tuple(sorted(self.free[i])[:need])) for i in chosen)

    def take(self, allocation):
        self.release(allocation, sign=-1)

    def in_use(self) -> int:
        slots = self.pool.gpus_per_node or 1
        return sum(slots - len(f) for f in self.free)


def gpus_needed(pool: Pool, gpus_per_node: int) -> int:
    """GPUs per node a job takes: all of the node's when it asks for 0."""
    return gpus_per_node or pool.gpus_per_node


def _usage(holdings, pools):
    nodes: dict[str, int] = {}  # team -> nodes held
    gpus: dict[str, int] = {}  # team -> GPUs held
    for h in holdings:
        nodes[h.team] = nodes.get(h.team, 0) + len(h.allocation)
        gpus[h.team] = gpus.get(h.team, 0) + sum(len(g) for _, g in h.allocation)
    return nodes, gpus


class _Pass:
    """One pass in progress: free capacity, each team's usage, blocked pools, the plan so far."""

    def __init__(self, pools: dict, quotas: dict, holdings, now: float):
        self.pools, self.quotas, self.now = pools, quotas, now
        self.by_pool: dict[str, list[Holding]] = {name: [] for name in pools}
        for h in holdings:
            self.by_pool.setdefault(h.pool, []).append(h)
        self.free = {name: _Free(pool, self.by_pool[name]) for name, pool in pools.items()}
        self.team_nodes, self.team_gpus = _usage(holdings, pools)
        self.blocked: dict[str, str] = {}  # pool -> reason every later job in it waits for
        self.out = Plan(start={}, preempt=[], waiting={}, wake_at=None)

    def consider(self, d: Demand):
        """Applies the rules to `d`, the next job in queue order."""
        out = self.out
        if d.not_before > self.now:
            self._back_off(d)
            return
        if d.pool in self.blocked:
            out.waiting[d.job_id] = self.blocked[d.pool]
            return
        pool = self.pools[d.pool]
        per_node = gpus_needed(pool, d.gpus_per_node)
        nodes_used, gpus_used = self.team_nodes.get(d.team, 0), self.team_gpus.get(d.team, 0)
        quota = self.quotas.get(d.team)
        if quota is not None:
            over = []
            if quota.max_nodes and nodes_used + d.nodes > quota.max_nodes:
                over.append(f"{nodes_used}/{quota.max_nodes} nodes")
            if quota.max_gpus and gpus_used + d.nodes * per_node > quota.max_gpus:
                over.append(f"{gpus_used}/{quota.max_gpus} GPUs")
            if over:
                out.waiting[d.job_id] = f"team {d.team} quota: {', '.join(over)} in use"
                return
        free = self.free[d.pool]
        allocation = free.fit(d.nodes, per_node)
        if allocation is not None:
            free.take(allocation)
            out.start[d.job_id] = allocation
            self.team_nodes[d.team] = nodes_used + d.nodes
            self.team_gpus[d.team] = gpus_used + d.nodes * per_node
            return
        victims = _victims(pool, free, self.by_pool[d.pool], d, per_node)
        out.preempt.extend(victims)
        unit = "GPUs" if pool.gpus_per_node else "nodes"
        total = pool.nodes * (pool.gpus_per_node or 1)
        reason = f"pool {d.pool} full ({free.in_use()}/{total} {unit} in use)"
        if victims:
            reason += f"; preempting {', '.join(victims)}"
        out.waiting[d.job_id] = reason
        self.blocked[d.pool] = f"behind {d.job_id} (priority {d.priority}) in pool {d.pool}"

    def wait_in_blocked_pools(self, rest: list):
        """`consider` for each of `rest` when all of them are in blocked pools, in bulk."""
        now, blocked, waiting = self.now, self.blocked, self.out.waiting
        backing_off = [d for d in rest if d.not_before > now]
        for d in rest:
            waiting[d.job_id] = blocked[d.pool]
        for d in backing_off:  # replaces the reason in place: `waiting` stays in queue order
            self._back_off(d)

    def _back_off(self, d: Demand):
        out = self.out
        out.waiting[d.job_id] = f"retry backoff: starts in {d.not_before - self.now:.0f} s"
        out.wake_at = d.not_before if out.wake_at is None else min(out.wake_at, d.not_before)


def plan(pools: dict, quotas: dict, pending, holdings, now: float) -> Plan:
    """One scheduling pass. `pending` are Demands, `holdings` the running jobs' Holdings.

    The rules are applied job by job in queue order until every pool that still has queued
    jobs is blocked; from there on a job can only wait (backoff, or behind its pool's first
    blocked job), which is set for all of them at once. With 100,000 queued jobs and full
    pools, that is one sort of plain integers and one dict, not 100,000 rule checks."""
    p = _Pass(pools, quotas, holdings, now)
    queue = sorted(pending, key=QUEUE_ORDER)
    left = collections.Counter(map(_POOL, queue))  # jobs not yet considered, per pool
    open_pools = set(left)  # pools with jobs left that are not blocked
    for i, d in enumerate(queue):
        p.consider(d)
        left[d.pool] -= 1
        if not left[d.pool] or d.pool in p.blocked:
            open_pools.discard(d.pool)
            if not open_pools:
                p.wait_in_blocked_pools(queue[i + 1 :])
                break
    return p.out


def plan_around_failures(
    pools: dict, quotas: dict, pending, holdings, now: float
) -> tuple[Plan, dict[str, Exception]]:
    """`plan`, and when it raises, the demands that make it raise alone are left out (returned
    with their errors, for the launcher to fail) and the rest is planned. A failure that no
    queued job explains (it raises with none queued) is raised: the pass fails, not a job."""
    try:
        return plan(pools, quotas, pending, holdings, now), {}
    except Exception:
        plan(pools, quotas, [], holdings, now)  # raises: not a job's doing
    sound, failed = [], {}
    for d in pending:
        try:
            plan(pools, quotas, [d], holdings, now)
            sound.append(d)
        except Exception as e:
            failed[d.job_id] = e
    return plan(pools, quotas, sound, holdings, now), failed


def plan_job_by_job(pools: dict, quotas: dict, pending, holdings, now: float) -> Plan:
    """The rules applied to every queued job in turn: the plain statement of what `plan`
    computes (scheduler_test checks that they agree; the benchmark times both)."""
    p = _Pass(pools, quotas, holdings, now)
    for d in sorted(pending, key=lambda d: (-d.priority, d.seq)):
        p.consider(d)
    return p.out


def _victims(pool: Pool, free: _Free, holdings, d: Demand, per_node: int) -> list:
    """The fewest lower-priority running jobs whose stop lets `d` fit (none if it never fits)."""
    trial = _Free(pool, [])
    trial.free = [set(f) for f in free.free]
    for h in holdings:
        if h.stopping:
            trial.release(h.allocation)
    if trial.fit(d.nodes, per_node) is not None:
        return []  # jobs already stopping will make room: wait for them
    candidates = [h for h in holdings if not h.stopping and h.priority < d.priority]
    candidates.sort(key=lambda h: (h.priority, -h.started))
    chosen = []
    for h in candidates:
        trial.release(h.allocation)
        chosen.append(h.job_id)
        if trial.fit(d.nodes, per_node) is not None:
            return chosen
    return []


def backoff_seconds(retry: job_pb2.RetryPolicy, failures: int) -> float:
    """Delay before the retry that follows the `failures`-th failed attempt (doubling)."""
    base = retry.backoff_seconds or DEFAULT_BACKOFF_SECONDS
    ceiling = max(retry.max_backoff_seconds or DEFAULT_MAX_BACKOFF_SECONDS, base)
    return min(base * 2 ** max(failures - 1, 0), ceiling)


@dataclasses.dataclass(frozen=True)
class Outcome:
    state: job_pb2.JobState
    failed: bool  # this attempt counts as a failure
    preempted: bool
    not_before: float  # retry backoff when requeued after a failure, else 0
    reason: str


def after_exit(
    job: job_pb2.Job, exit_code: int | None, detail: str, now: float, never_started=False
) -> Outcome:
    """What an ended attempt means for its job. exit_code None: the process vanished."""
    stop = job.stop
    if exit_code == 0:
        return Outcome(job_pb2.SUCCEEDED, False, False, 0.0, "succeeded")
    if stop == job_pb2.STOP_CANCEL:
        return Outcome(job_pb2.CANCELLED, False, False, 0.0, "cancelled")
    if never_started:
        return Outcome(job_pb2.QUEUED, False, False, 0.0, f"requeued: {detail}")
    if stop == job_pb2.STOP_PREEMPT or (
        exit_code == ExitCode.PREEMPTED and stop != job_pb2.STOP_HANG
    ):
        who = "for a higher-priority job" if stop == job_pb2.STOP_PREEMPT else "by a SIGTERM"
        return Outcome(job_pb2.PREEMPTED, False, True, 0.0, f"preempted {who}; requeued")
    if stop == job_pb2.STOP_HANG:
        what = f"hung: {detail}"
    elif exit_code is None:
        what = f"lost: {detail}"
    else:
        what = f"exit code {exit_code}" + (f": {detail}" if detail else "")
    failures = job.failures + 1
    max_attempts = job.spec.retry.max_attempts or DEFAULT_MAX_ATTEMPTS
    if exit_code == ExitCode.BAD_CONFIG and stop != job_pb2.STOP_HANG:
        return Outcome(job_pb2.FAILED, True, False, 0.0, f"bad config ({what}); not retried")
    if failures >= max_attempts:
        return Outcome(
            job_pb2.FAILED, True, False, 0.0, f"{what} (failure {failures} of {max_attempts})"
        )
    delay = backoff_seconds(job.spec.retry, failures)
    reason = f"{what} (failure {failures} of {max_attempts}); retrying in {delay:.0f} s"
    return Outcome(job_pb2.QUEUED, True, False, now + delay, reason)


def hung(last_sign_of_life: float, timeout: float, now: float) -> bool:
    """No progress report, metrics line or start within `timeout` seconds."""
    return timeout > 0 and now - last_sign_of_life > timeout
