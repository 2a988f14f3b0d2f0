"""Writes Kitchen's Grafana dashboards as JSON (the files Grafana provisioning loads).

    bazel run //observability/dashboards:generate            # rewrite the committed JSON
    bazel run //observability/dashboards:generate -- --check # exit 1 if the JSON is stale

The JSON is committed so Grafana needs no Python; generate_test.py fails when it is stale.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from observability.dashboards import fleet_dashboard, run_dashboard, serve_dashboard
from observability.queries import DASHBOARDS_DIR
from protos.files import write_atomic

BUILDERS = (run_dashboard, fleet_dashboard, serve_dashboard)


def to_json(board: Dashboard) -> str:
    """Stable JSON: panel ids numbered in order (Grafana needs them unique), sorted keys."""
    for panel_id, panel in enumerate(board.panels or [], start=1):
        panel.id_val = panel_id
    return json.dumps(board, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{module.UID}.json": to_json(module.build()) for module in BUILDERS}


def stale_files(directory: Path) -> list[str]:
    """Dashboards whose committed JSON differs from what the code renders (or is missing)."""
    return [
        name
        for name, text in render_all().items()
        if not (directory / name).is_file() or (directory / name).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    # Under `bazel run` the module sits in the runfiles tree; write into the source tree.
    workspace = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    directory = (
        Path(workspace) / "observability/grafana/dashboards" if workspace else DASHBOARDS_DIR
    )
    stale = stale_files(directory)
    if args.check:
        for name in stale:
            print(f"stale: {directory / name}")
        return 1 if stale else 0
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        write_atomic(str(directory / name), text)
        print(f"{'wrote' if name in stale else 'unchanged'}: {directory / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
