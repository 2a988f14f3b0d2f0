"""The scheduling rules, deterministically: plain values in, a plan out, `now` chosen here."""

import random

import pytest

from launcher import scheduler
from launcher.scheduler import Demand, Holding, Pool, Quota, plan
from protos import job_pb2

CPU = {"cpu": Pool("cpu", nodes=2, gpus_per_node=0)}
GPU = {"gpu": Pool("gpu", nodes=2, gpus_per_node=4)}


def demand(job_id, seq, priority=0, pool="cpu", team="a", nodes=1, gpus=0, not_before=0.0):
    return Demand(job_id, seq, priority, pool, team, nodes, gpus, not_before)


def holding(job_id, allocation, priority=0, pool="cpu", team="a", started=0.0, stopping=False):
    return Holding(job_id, priority, pool, team, allocation, started, stopping)


def test_priority_first_then_fifo():
    pending = [demand("late", 3), demand("early", 1), demand("urgent", 5, priority=9)]
    pending.append(demand("later", 4))
    p = plan(CPU, {}, pending, [], now=100)
    assert list(p.start) == ["urgent", "early"]
    assert p.waiting["late"] == "pool cpu full (2/2 nodes in use)"
    assert p.waiting["later"] == "behind late (priority 0) in pool cpu"


def test_gang_admission_all_or_nothing_and_no_backfill():
    pending = [demand("big", 1, nodes=2), demand("small", 2)]
    running = [holding("r", ((0, ()),))]
    p = plan(CPU, {}, pending, running, now=0)
    assert p.start == {}  # big needs both nodes: it gets none, and small may not jump it
    assert p.waiting["big"] == "pool cpu full (1/2 nodes in use)"
    assert "behind big" in p.waiting["small"]


def test_gpu_pool_best_fit_per_node():
    running = [holding("r", ((0, (0, 1, 2)),), pool="gpu")]
    p = plan(GPU, {}, [demand("one", 1, pool="gpu", gpus=1)], running, now=0)
    assert p.start["one"] == ((0, (3,)),)  # fills the busy node, keeps node 1 whole
    p = plan(GPU, {}, [demand("whole", 1, pool="gpu", gpus=0)], running, now=0)
    assert p.start["whole"] == ((1, (0, 1, 2, 3)),)
    p = plan(GPU, {}, [demand("two", 1, pool="gpu", nodes=2, gpus=2)], running, now=0)
    assert p.start == {}


def test_team_quota_holds_back_without_blocking_others():
    quotas = {"a": Quota(max_nodes=1, max_gpus=0)}
    running = [holding("r", ((0, ()),), team="a")]
    pending = [demand("a2", 1, team="a"), demand("b1", 2, team="b")]
    p = plan(CPU, quotas, pending, running, now=0)
    assert list(p.start) == ["b1"]
    assert p.waiting["a2"] == "team a quota: 1/1 nodes in use"
    gpu_quota = {"a": Quota(max_nodes=0, max_gpus=4)}
    p = plan(GPU, gpu_quota, [demand("g", 1, pool="gpu", nodes=2, gpus=4)], [], now=0)
    assert p.waiting["g"] == "team a quota: 0/4 GPUs in use"


def test_backoff_waits_and_sets_wake_time():
    pending = [demand("retry", 1, not_before=130.0), demand("fresh", 2)]
    p = plan(CPU, {}, pending, [], now=100.0)
    assert list(p.start) == ["fresh"]
    assert p.waiting["retry"] == "retry backoff: starts in 30 s"
    assert p.wake_at == 130.0
    assert "retry" in plan(CPU, {}, pending, [], now=130.5).start


def test_preempts_fewest_lowest_priority_newest_first():
    running = [
        holding("old-low", ((0, ()),), priority=1, started=10),
        holding("new-low", ((1, ()),), priority=1, started=20),
    ]
    p = plan(CPU, {}, [demand("vip", 1, priority=5)], running, now=30)
    assert p.preempt == ["new-low"]
    assert p.start == {}
    assert p.waiting["vip"].endswith("preempting new-low")
    # Equal or higher priority is never preempted.
    p = plan(CPU, {}, [demand("peer", 1, priority=1)], running, now=30)
    assert p.preempt == []


def test_no_new_victims_while_earlier_ones_stop_and_none_if_hopeless():
    running = [
        holding("stopping", ((0, ()),), priority=0, stopping=True),
        holding("other", ((1, ()),), priority=0),
    ]
    assert plan(CPU, {}, [demand("vip", 1, priority=5)], running, now=0).preempt == []
    high = [holding("h", ((0, ()),), priority=9), holding("l", ((1, ()),), priority=0)]
    assert plan(CPU, {}, [demand("vip", 1, priority=5, nodes=2)], high, now=0).preempt == []


def test_backoff_doubles_up_to_the_ceiling():
    policy = job_pb2.RetryPolicy(backoff_seconds=2, max_backoff_seconds=10)
    assert [scheduler.backoff_seconds(policy, f) for f in (1, 2, 3, 4)] == [2, 4, 8, 10]
    assert scheduler.backoff_seconds(job_pb2.RetryPolicy(), 1) == 5.0


def make_job(failures=0, stop=job_pb2.STOP_REASON_UNSPECIFIED, max_attempts=3):
    job = job_pb2.Job(failures=failures, stop=stop)
    job.spec.retry.max_attempts = max_attempts
    job.spec.retry.backoff_seconds = 4
    return job


@pytest.mark.parametrize(
    "job, code, state, failed, not_before",
    [
        (make_job(), 0, job_pb2.SUCCEEDED, False, 0),
        (make_job(), 1, job_pb2.QUEUED, True, 104),
        (make_job(failures=1), 1, job_pb2.QUEUED, True, 108),
        (make_job(failures=2), 1, job_pb2.FAILED, True, 0),
        (make_job(), None, job_pb2.QUEUED, True, 104),
        (make_job(), 2, job_pb2.FAILED, True, 0),
        (make_job(), 75, job_pb2.PREEMPTED, False, 0),
        (make_job(stop=job_pb2.STOP_PREEMPT), 137, job_pb2.PREEMPTED, False, 0),
        (make_job(stop=job_pb2.STOP_CANCEL), 75, job_pb2.CANCELLED, False, 0),
        (make_job(stop=job_pb2.STOP_HANG), 75, job_pb2.QUEUED, True, 104),
        (make_job(failures=2, stop=job_pb2.STOP_HANG), 137, job_pb2.FAILED, True, 0),
    ],
)
def test_after_exit(job, code, state, failed, not_before):
    out = scheduler.after_exit(job, code, "boom", now=100.0)
    assert (out.state, out.failed, out.not_before) == (state, failed, not_before)


def test_after_exit_reasons_are_readable():
    out = scheduler.after_exit(make_job(), 1, "ValueError: x", now=0)
    assert out.reason == "exit code 1: ValueError: x (failure 1 of 3); retrying in 4 s"
    out = scheduler.after_exit(make_job(), None, "", now=0, never_started=True)
    assert (out.state, out.failed) == (job_pb2.QUEUED, False)


def test_hung():
    assert scheduler.hung(last_sign_of_life=0, timeout=10, now=10.5)
    assert not scheduler.hung(last_sign_of_life=0, timeout=10, now=9.5)
    assert not scheduler.hung(last_sign_of_life=0, timeout=0, now=1e9)


def random_workload(rng: random.Random):
    pools = {}
    for i in range(rng.randint(1, 3)):
        name = f"p{i}"
        pools[name] = Pool(name, nodes=rng.randint(1, 6), gpus_per_node=rng.choice([0, 2, 4, 8]))
    teams = ["a", "b", "c"]
    quotas = {t: Quota(rng.randint(0, 4), rng.randint(0, 16)) for t in teams if rng.random() < 0.5}
    holdings: list[Holding] = []
    for name, pool in pools.items():
        for node in range(pool.nodes):
            if rng.random() < 0.5:
                slots = list(range(pool.gpus_per_node))
                gpus = tuple(sorted(rng.sample(slots, rng.randint(1, len(slots))))) if slots else ()
                job_id = f"r{len(holdings)}"
                holdings.append(
                    holding(job_id, ((node, gpus),), rng.randint(-2, 5), name, rng.choice(teams),
                            started=rng.uniform(0, 100), stopping=rng.random() < 0.1)
                )  # fmt: skip
    # Some pools get no queued jobs: a pass must not wait for them to block.
    queued_in = rng.sample(list(pools), rng.randint(1, len(pools)))
    seqs = rng.sample(range(1, 10_000), rng.randint(0, 300))
    pending = []
    for seq in seqs:
        pool = pools[rng.choice(queued_in)]
        not_before = rng.uniform(100, 200) if rng.random() < 0.2 else rng.choice([0.0, 50.0])
        pending.append(
            demand(f"j{seq}", seq, rng.randint(-2, 5), pool.name, rng.choice(teams),
                   rng.randint(1, pool.nodes), rng.randint(0, pool.gpus_per_node), not_before)
        )  # fmt: skip
    return pools, quotas, pending, holdings


def test_plan_equals_the_rules_applied_job_by_job(monkeypatch):
    swept = []  # how many jobs each pass left to the one-sweep shortcut
    sweep = scheduler._Pass.wait_in_blocked_pools

    def spy(self, rest):
        swept.append(len(rest))
        sweep(self, rest)

    monkeypatch.setattr(scheduler._Pass, "wait_in_blocked_pools", spy)
    for seed in range(400):
        pools, quotas, pending, holdings = random_workload(random.Random(seed))
        fast = plan(pools, quotas, pending, holdings, now=100.0)
        reference = scheduler.plan_job_by_job(pools, quotas, pending, holdings, now=100.0)
        assert list(fast.start.items()) == list(reference.start.items()), seed
        assert fast.preempt == reference.preempt, seed
        assert list(fast.waiting.items()) == list(reference.waiting.items()), seed
        assert fast.wake_at == reference.wake_at, seed
    # Both ways were taken: passes that ended in a sweep, and passes that never could.
    assert sum(n > 10 for n in swept) > 100 and len(swept) < 400


def test_a_demand_the_rules_choke_on_is_left_out_and_the_rest_planned():
    pending = [demand("a", 1), demand("broken", 2, pool="gone"), demand("b", 3)]
    with pytest.raises(KeyError):
        plan(CPU, {}, pending, [], now=0)
    p, failed = scheduler.plan_around_failures(CPU, {}, pending, [], now=0)
    assert list(p.start) == ["a", "b"]
    assert list(failed) == ["broken"] and isinstance(failed["broken"], KeyError)
    assert scheduler.plan_around_failures(CPU, {}, pending[:1], [], now=0)[1] == {}


def test_a_failure_no_queued_job_explains_fails_the_pass(monkeypatch):
    def broken(pools, quotas, pending, holdings, now):
        raise RuntimeError("the pass itself")

    monkeypatch.setattr(scheduler, "plan", broken)
    with pytest.raises(RuntimeError, match="the pass itself"):
        scheduler.plan_around_failures(CPU, {}, [demand("a", 1)], [], now=0)


def test_queue_order_is_priority_then_seq_for_any_rowid():
    pending = [demand("low", 1, priority=-3), demand("last", 2**63 - 1), demand("first", 5)]
    pending += [demand("vip", 2**62, priority=2**31 - 1)]
    assert [d.job_id for d in sorted(pending, key=lambda d: d.order)] == [
        "vip", "first", "last", "low",
    ]  # fmt: skip
