"""A trainer written by an attacker: it tries to read what a job must never see, and says what it
got in `<run dir>/probe.json` (standard library only).

    hostile_trainer.py --targets TARGETS.json --attempt ATTEMPT.json

TARGETS.json: {"read": [paths], "write": [paths], "secret": "text"}. For each path of "read"
it records the first 40 bytes or the error; for each of "write" whether appending worked; it
looks for `secret` in its own environment and in every /proc/<pid>/environ and cmdline it can
open, and tries /proc/<pid>/root/<path> of each visible process for each "read" path.
"""

import json
import os
import sys


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return "READ " + f.read(40).decode(errors="replace")
    except OSError as e:
        return f"denied: {e.strerror}"


def _write(path: str) -> str:
    try:
        with open(path, "a") as f:
            f.write("tampered\n")
        return "WROTE"
    except OSError as e:
        return f"denied: {e.strerror}"


def main(argv: list[str]) -> int:
    targets = json.load(open(argv[argv.index("--targets") + 1]))
    attempt = json.load(open(argv[argv.index("--attempt") + 1]))
    secret = targets["secret"]
    probe: dict = {"read": {p: _read(p) for p in targets["read"]}}
    probe["write"] = {p: _write(p) for p in targets["write"]}
    probe["env_has_secret"] = any(secret in v for v in os.environ.values())
    probe["env"] = sorted(os.environ)
    found, through_root = [], {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        for part in ("environ", "cmdline"):
            if secret in _read(f"/proc/{pid}/{part}"):
                found.append(f"{pid}/{part}")
        for path in targets["read"]:
            got = _read(f"/proc/{pid}/root{path}")
            if got.startswith("READ"):
                through_root[f"/proc/{pid}/root{path}"] = got
    probe["proc_secret"] = found
    probe["through_proc_root"] = through_root
    probe["pids_seen"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    probe["own_run_dir_writable"] = _write(os.path.join(attempt["run_dir"], "mine.txt"))
    probe["cache_writable"] = _write(os.path.join(attempt["cache_dir"], "mine.txt"))
    with open(os.path.join(attempt["run_dir"], "probe.json"), "w") as f:
        json.dump(probe, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
