"""A job for run_image tests, run inside an image: reports what it sees in its run dir.

job.py RUN_DIR report      write report.json and exit 0
job.py RUN_DIR exit:N      exit with status N
job.py RUN_DIR wait        write `ready`, then on SIGTERM write `preempted` and exit 75
"""

import json
import os
import signal
import sys
import time


def main() -> int:
    run_dir, mode = sys.argv[1], sys.argv[2]
    if mode.startswith("exit:"):
        return int(mode.split(":", 1)[1])
    if mode == "wait":

        def preempted(signum, _frame):
            with open(os.path.join(run_dir, "preempted"), "w") as f:
                f.write(signal.Signals(signum).name)
            sys.exit(75)

        signal.signal(signal.SIGTERM, preempted)
        with open(os.path.join(run_dir, "ready"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
        return 1
    try:
        with open("/etc/written-by-job", "w") as f:
            f.write("x")
        root_writable = True
    except OSError:
        root_writable = False
    report = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "python": list(sys.version_info[:2]),
        "root_writable": root_writable,
        "tmp_writable": os.access("/tmp", os.W_OK),
        "os_release": open("/etc/os-release").read(),
    }
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
