"""How long the MLflow run page takes to draw a long run's loss chart, beside a short run's.

Imports a 50-step and a 10,000-step run (synthetic metrics.jsonl in the trainer's format) into a
fresh embedded store, starts `kitchen mlflow` over it, and times in headless Chromium, from
navigation to the loss chart holding its points, each run page REPEATS times (alternating), two
ways: a cold load (a new page: the UI's JavaScript bundle fetched from the cache, parsed and run
again, as when a link is opened in a new tab) and opened from the experiment's run list with the
UI already running (the hash route changed, as when a user clicks a run). Prints the medians,
their ratio and how many points the chart drew.

    PYTHONPATH=.:.gen python launcher/bench/run_page_bench.py
"""

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request

import mlflow
from mlflow.tracking import MlflowClient
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from launcher import cli
from launcher.bench.machine import machine
from launcher.settings import embedded_tracking_uri
from launcher.tracking.commands import ui_command
from launcher.tracking.testing import free_port, write_run
from protos import job_pb2

REPEATS = 5
LOSS_POINTS = """const p = Array.from(document.querySelectorAll('.js-plotly-plot')).find(p => {
  let c = p; while (c.parentElement && !/^[a-z]/i.test(c.innerText || '')) c = c.parentElement;
  return (c.innerText || '').split('\\n')[0] === 'loss'; });
return p && p.data && p.data.length ? p.data[0].x.length : 0;"""
# Where a page load's time went (the browser's Resource Timing, ms from navigation start): the
# UI's static files, and each REST call it made to MLflow's server.
RESOURCES = """const nav = performance.getEntriesByType('navigation')[0];
return {dom: nav ? nav.domContentLoadedEventEnd : null,
  resources: performance.getEntriesByType('resource').map(r => ({name: r.name,
    start: r.startTime, end: r.responseEnd, bytes: r.transferSize}))};"""


def breakdown(timing: dict, drawn_ms: float) -> list[str]:
    """The last load of one run page: static files, then REST calls grouped by endpoint."""
    static: list[dict] = []
    calls: dict[str, list[dict]] = {}
    for r in timing["resources"]:
        path = r["name"].split("://", 1)[-1].split("/", 1)[-1]
        if "ajax-api/" in path or path.startswith("api/"):
            endpoint = path.split("?", 1)[0]
            calls.setdefault(endpoint, []).append(r)
        else:
            static.append(r)
    lines = [
        f"    DOMContentLoaded {timing['dom'] or 0:.0f} ms; {len(static)} static files "
        f"({sum(r['bytes'] or 0 for r in static) / 1e6:.2f} MB over the network, 0 when "
        f"cached), last done at {max((r['end'] for r in static), default=0):.0f} ms; loss "
        f"chart drawn at "
        f"{drawn_ms:.0f} ms"
    ]
    for endpoint, rs in sorted(calls.items(), key=lambda kv: min(r["start"] for r in kv[1])):
        durations = [r["end"] - r["start"] for r in rs]
        lines.append(
            f"    {len(rs):>3} x {endpoint}: first sent at {min(r['start'] for r in rs):.0f} ms, "
            f"last answered at {max(r['end'] for r in rs):.0f} ms, each {min(durations):.0f}-"
            f"{max(durations):.0f} ms"
        )
    return lines


def drawn_after(driver: webdriver.Chrome, navigate) -> tuple[float, int]:
    """(seconds from `navigate()` to the page's loss chart holding its points, its points)."""
    started = time.perf_counter()
    navigate()
    while not (points := driver.execute_script(LOSS_POINTS)):
        time.sleep(0.02)
    return time.perf_counter() - started, points


def set_route(driver: webdriver.Chrome, route: str) -> None:
    """Go to `route` (#/...) inside the running UI: no page load, as a click on a link does."""
    driver.execute_script("window.location.hash = arguments[0]", route)


def main() -> None:
    root = tempfile.mkdtemp(prefix="run_page_bench-")
    state = os.path.join(root, "state")
    for steps in (50, 10_000):
        spec = job_pb2.JobSpec(name=f"steps-{steps}", kind=job_pb2.PRETRAIN, team="bench")
        noise = random.Random(steps)
        losses = [4 - 2 * s / steps + noise.gauss(0, 0.01) for s in range(1, steps + 1)]
        write_run(os.path.join(root, spec.name), spec.name, spec, losses)
        cli.main(["track", "import", os.path.join(root, spec.name), "--state-dir", state])
    client = MlflowClient(embedded_tracking_uri(state))
    experiment = client.get_experiment_by_name("kitchen/bench")
    assert experiment is not None
    runs = {r.info.run_name: r.info.run_id for r in client.search_runs([experiment.experiment_id])}
    port = free_port()
    ui = subprocess.Popen(
        ui_command(state, port), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        times: dict[str, list[float]] = {name: [] for name in runs}
        warm: dict[str, list[float]] = {name: [] for name in runs}
        drawn: dict[str, int] = {}
        timings: dict[str, tuple[dict, float]] = {}
        run_list = f"#/experiments/{experiment.experiment_id}"  # the UI's route to the runs
        home = f"http://127.0.0.1:{port}/{run_list}"
        for _ in range(REPEATS):
            for name, run in sorted(runs.items()):
                page = f"{home}/runs/{run}/model-metrics"
                driver.get("about:blank")
                seconds, drawn[name] = drawn_after(driver, lambda p=page: driver.get(p))
                times[name].append(seconds)
                timings[name] = (driver.execute_script(RESOURCES), 1000 * times[name][-1])
        driver.get(home)  # the run list, the UI loaded once
        for _ in range(REPEATS):
            for name, run in sorted(runs.items()):
                set_route(driver, run_list)
                while driver.execute_script(LOSS_POINTS):  # the last run's chart is gone
                    time.sleep(0.02)
                time.sleep(1.0)  # the run list settled
                route = f"{run_list}/runs/{run}/model-metrics"
                seconds, _ = drawn_after(driver, lambda r=route: set_route(driver, r))
                warm[name].append(seconds)
    finally:
        driver.quit()
        ui.terminate()
        ui.wait(30)
    print(f"# {time.strftime('%Y-%m-%d')}, {machine()}, MLflow {mlflow.__version__}")
    print("a cold load (a new page):")
    short, long = (statistics.median(times[f"steps-{n}"]) for n in (50, 10_000))
    for n, median in ((50, short), (10_000, long)):
        name = f"steps-{n}"
        print(
            f"{n:>6} logged steps: loss chart drawn in {median:.2f} s (median of {REPEATS}; "
            f"all {json.dumps([round(t, 2) for t in times[name]])}), {drawn[name]} points"
        )
    print(f"ratio 10,000 / 50 steps: {long / short:.2f}x")
    print("opened from the run list, the UI already running:")
    for n in (50, 10_000):
        name = f"steps-{n}"
        print(
            f"{n:>6} logged steps: loss chart drawn in {statistics.median(warm[name]):.2f} s "
            f"(median of {REPEATS}; all {json.dumps([round(t, 2) for t in warm[name]])})"
        )
    for n in (50, 10_000):
        history = client.get_metric_history(runs[f"steps-{n}"], "loss")
        keys = sorted(client.get_run(runs[f"steps-{n}"]).data.metrics)
        points = len(history)
        print(f"{n:>6} logged steps, last load: {len(keys)} metrics {keys}, {points} loss points")
        print("\n".join(breakdown(*timings[f"steps-{n}"])))


if __name__ == "__main__":
    main()
