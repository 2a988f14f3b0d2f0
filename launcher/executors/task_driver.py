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
that failed (prepare, the lowest failed task, merge), else 0; each failure is named on stderr.
"""

import json
import signal
import subprocess
import sys
import time

stopping: list[int] = []


def start(step: dict) -> subprocess.Popen:
    with open(step["log"], "ab") as log:
        return subprocess.Popen(step["argv"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def run_one(step: dict, what: str) -> int:
    code = start(step).wait()
    if code != 0:
        print(f"precook {what} exited {code} (log: {step['log']})", file=sys.stderr, flush=True)
    return code


def run_tasks(tasks: list, n: int, parallel: int) -> int:
    """Every task, `parallel` at a time; the exit code of the lowest failed one (else 0)."""
    waiting = list(tasks)
    running: dict[int, tuple[subprocess.Popen, dict]] = {}
    failed: dict[int, int] = {}
    while waiting or running:
        while waiting and len(running) < parallel and not stopping:
            index, step = waiting.pop(0)
            running[index] = (start(step), step)
        for index, (proc, step) in list(running.items()):
            if proc.poll() is not None:
                del running[index]
                if proc.returncode != 0:
                    failed[index] = proc.returncode
                    print(
                        f"precook task {index} of {n} exited {proc.returncode} "
                        f"(log: {step['log']})",
                        file=sys.stderr,
                        flush=True,
                    )
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
