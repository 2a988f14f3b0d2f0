"""Runs the steps of a PRECOOK job's attempt on this machine (task_array.py): prepare, then the
tasks as local processes (at most `parallel` at once), then merge.

    python task_driver.py PLAN.json

Standard library only, like attempt_wrapper.py, and run by path as the attempt's command (the
attempt's own wrapper records how it ended). PLAN.json, written by the local executor:
{"prepare": STEP, "tasks": [[index, STEP], ...], "merge": STEP, "n_tasks": N, "parallel": K},
where a STEP is {"argv": the wrapped trainer command, "log": its output file}. Every step runs
under its own attempt_wrapper.py, in this process group (a SIGTERM to the group reaches every
step's wrapper, which forwards it to its trainer; a SIGKILL kills the wrappers, and the local
executor kills the trainers' groups from their pid.json). Exit code: that of the first step
that failed (prepare, the lowest failed task, merge), else 0. Its own log says when each step
started and how it ended.
"""

import json
import signal
import subprocess
import sys
import time

stopping: list[int] = []


def start(step: dict, what: str) -> subprocess.Popen:
    say(f"precook {what}: started (log: {step['log']})")
    with open(step["log"], "ab") as log:
        return subprocess.Popen(step["argv"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def ended(what: str, code: int) -> None:
    say(f"precook {what} exited {code}" if code else f"precook {what}: done")


def say(line: str) -> None:
    """A line of the attempt's own log (`kitchen logs`): which step runs, how each ended."""
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def run_one(step: dict, what: str) -> int:
    code = start(step, what).wait()
    ended(what, code)
    return code


def run_tasks(tasks: list, n: int, parallel: int) -> int:
    """Every task, `parallel` at a time; the exit code of the lowest failed one (else 0)."""
    waiting = list(tasks)
    running: dict[int, subprocess.Popen] = {}
    failed: dict[int, int] = {}
    while waiting or running:
        while waiting and len(running) < parallel and not stopping:
            index, step = waiting.pop(0)
            running[index] = start(step, f"task {index} of {n}")
        for index, proc in list(running.items()):
            if proc.poll() is not None:
                del running[index]
                ended(f"task {index} of {n}", proc.returncode)
                if proc.returncode != 0:
                    failed[index] = proc.returncode
        if stopping and not running:
            break
        time.sleep(0.05)
    return failed[min(failed)] if failed else 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: task_driver.py PLAN.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        plan = json.load(f)
    # The group's SIGTERM also reaches every step's wrapper: start nothing more, let them end.
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    code = run_one(plan["prepare"], "prepare")
    if code == 0 and not stopping:
        code = run_tasks(plan["tasks"], plan["n_tasks"], plan["parallel"])
    if code == 0 and not stopping:
        code = run_one(plan["merge"], "merge")
    if stopping and code == 0:
        code = 128 + stopping[0]
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
