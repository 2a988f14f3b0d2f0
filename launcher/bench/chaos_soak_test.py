"""The chaos soak, short (launcher/bench/chaos_soak.py): 8 jobs on two launcher replicas and a
real PostgreSQL, a fault every 3-5 s for 25 s (kill -9 of the leader, a follower or a trainer)
and one database crash-restart, beside one real tiny pretrain job whose trainer is killed -9
mid-run. Nothing lost, nothing run twice at once, every job finished, and the real job's final
weights bitwise equal to an uninterrupted run of its spec (run first, on the same launchers)."""

from launcher.bench import chaos_soak


def test_a_short_soak_loses_nothing_and_runs_nothing_twice():
    text, outcome = chaos_soak.soak(
        ["--jobs", "8", "--replicas", "2", "--chaos-seconds", "25", "--fault-every", "3", "5",
         "--submit-interval", "0.5", "--drain-seconds", "180", "--seed", "7",
         "--real-jobs", "1", "--real-steps", "30"]
    )  # fmt: skip
    print(text)
    assert outcome.lost == [] and outcome.twice == [], text
    assert outcome.terminal == outcome.stored == 8 + 1 + 1, text  # and the reference run
    assert outcome.weights_differ == [] and len(outcome.weights_equal) == 1, text


def test_twice_at_once_reads_the_steps_log(tmp_path):
    log = tmp_path / "steps.log"
    for lines, twice in (
        ("1 1\n1 2\n2 2\n2 3\n", False),  # a retry resuming from a checkpoint
        ("1 1\n2 1\n1 2\n", True),  # attempt 1 stepped after attempt 2 began
        ("1 1\n1 2\n1 2\n", True),  # one attempt's step run twice (two processes)
    ):
        log.write_text(lines)
        assert chaos_soak.twice_at_once(log) == twice, lines
