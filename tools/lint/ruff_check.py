"""Lint test: ruff's checks and formatting over one package's Python files."""

import subprocess
import sys


def main() -> int:
    config, *files = sys.argv[1:]
    if not files:
        return 0
    check = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", config, *files])
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--diff", "--config", config, *files]
    )
    if check.returncode or fmt.returncode:
        print("fix with: ruff check --fix && ruff format (config: ruff.toml)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
