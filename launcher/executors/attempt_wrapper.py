"""Runs one attempt of a job and records how it ended, so a restarted launcher can find out.

    python attempt_wrapper.py --attempt-dir DIR -- trainer argv...

Standard library only: it runs under any Python, also on a Slurm node. In DIR it
- holds `lock` (flock) while alive: a second wrapper for the same attempt exits at once
  (code 86) without starting anything, so no attempt ever runs twice;
- writes `pid.json` (its own pid and start time, the trainer's process group) before the
  trainer starts, and `exit.json` (the trainer's exit code) when it ends; an `exit.json`
  already there (written by a launcher that gave up on this attempt) also means: do nothing.
SIGTERM/SIGINT/SIGHUP are forwarded to the trainer's process group; the wrapper keeps waiting
so that it can record the exit code of a trainer that checkpoints and exits 75.

With `--sandboxed` the command is a bubblewrap command (launcher/executors/sandbox.py): those
signals go to the sandboxed command itself, found through bwrap's --info-fd (bwrap passes none
on, and its own processes die of a SIGTERM, taking the sandbox with them); `pid.json` names it
as `term_pid`. SIGKILL to the process group still ends the whole sandbox.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

DUPLICATE = 86


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (with the pid: a unique identity)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def write_json_atomically(path: str, data: dict):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sandboxed_pid(info_fd: int) -> int | None:
    """The host pid of the command bwrap runs: the one child of the sandbox's init process,
    whose pid bwrap writes to `info_fd` (None: bwrap ended before starting it)."""
    with os.fdopen(info_fd) as info:
        text = info.read()
    if not text.strip():
        return None
    init = json.loads(text)["child-pid"]
    for _ in range(500):
        try:
            with open(f"/proc/{init}/task/{init}/children") as f:
                children = f.read().split()
        except OSError:
            return None
        if children:
            return int(children[0])
        time.sleep(0.01)
    return None


def main(argv: list[str]) -> int:
    sandboxed = len(argv) > 2 and argv[2] == "--sandboxed"
    if sandboxed:
        argv = argv[:2] + argv[3:]
    if len(argv) < 4 or argv[0] != "--attempt-dir" or argv[2] != "--":
        print(
            "usage: attempt_wrapper.py --attempt-dir DIR [--sandboxed] -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    attempt_dir, command = argv[1], argv[3:]
    os.makedirs(attempt_dir, exist_ok=True)
    lock = open(os.path.join(attempt_dir, "lock"), "a")  # noqa: SIM115 - held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return DUPLICATE
    exit_path = os.path.join(attempt_dir, "exit.json")
    if os.path.exists(exit_path):
        return DUPLICATE

    pending = []
    target: dict = {}  # "pgid" (the trainer's group) or "pid" (the sandboxed command), once known

    def forward(signum, _frame):
        if not target:
            pending.append(signum)
            return
        try:
            if "pid" in target:
                os.kill(target["pid"], signum)
            else:
                os.killpg(target["pgid"], signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    info_read, info_write = os.pipe() if sandboxed else (-1, -1)
    if sandboxed:
        command = [command[0], "--info-fd", str(info_write), *command[1:]]
    try:
        child = subprocess.Popen(
            command, process_group=0, pass_fds=(info_write,) if sandboxed else ()
        )
    except OSError as e:
        print(f"attempt_wrapper: cannot start {command[0]!r}: {e}", file=sys.stderr, flush=True)
        write_json_atomically(exit_path, {"code": 127, "error": str(e), "finished": time.time()})
        return 127
    pids = {
        "pid": os.getpid(),
        "start_ticks": start_ticks(os.getpid()),
        "child_pgid": child.pid,
        "child_start_ticks": start_ticks(child.pid),
    }
    inner = None
    if sandboxed:
        os.close(info_write)
        inner = sandboxed_pid(info_read)
    if inner is not None:
        pids["term_pid"] = inner
        target["pid"] = inner
    else:
        target["pgid"] = child.pid
    write_json_atomically(os.path.join(attempt_dir, "pid.json"), pids)
    for signum in pending:
        forward(signum, None)
    code = child.wait()
    if code < 0:
        code = 128 - code  # killed by signal N: the shell's convention, 128 + N
    write_json_atomically(exit_path, {"code": code, "finished": time.time()})
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
