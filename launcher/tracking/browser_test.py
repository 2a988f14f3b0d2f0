"""The MLflow UI seen in a real browser: Debian's Chromium, headless, driven by selenium, against
`kitchen mlflow` (the UI over the launcher's embedded store) on 127.0.0.1.

Two runs that differ in their learning rate are imported with `kitchen track import`; the run
page must draw the loss chart with one point per logged step, and the compare view must pick
out the params that differ. Prometheus's own graph page (its classic UI, the one Debian's
package ships), scraping a real launcher while a job runs, must draw that job's MFU and step
time. Screenshots go to $TEST_UNDECLARED_OUTPUTS_DIR (Bazel keeps them in
.bazel/testlogs/launcher/tracking/browser_test/test.outputs/); docs/images/ has copies.
"""

import json
import os
import random
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from mlflow.tracking import MlflowClient
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from launcher import cli
from launcher.settings import embedded_tracking_uri
from launcher.testdata import harness
from launcher.tracking.commands import ui_command
from launcher.tracking.testing import free_port, write_run
from observability.prometheus_server import running_prometheus
from protos import job_pb2

STEPS = 50
CHROMEDRIVER = "/usr/bin/chromedriver"  # Debian chromium-driver (tools/debian-packages.txt)


def _spec(name: str, lr: float) -> job_pb2.JobSpec:
    spec = job_pb2.JobSpec(name=name, kind=job_pb2.PRETRAIN, team="nlp", owner="ada")
    spec.trainer.optim.lr = lr
    spec.trainer.train.steps = STEPS
    return spec


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """(base URL, experiment id, {run name: run id}) of `kitchen mlflow` over two runs."""
    root = tmp_path_factory.mktemp("ui")
    state = str(root / "state")
    for name, lr, seed in (("tiny-lr3e-4", 3e-4, 1), ("tiny-lr1e-3", 1e-3, 2)):
        noise = random.Random(seed)
        losses = [4 - s / 50 + noise.gauss(0, 0.01) for s in range(1, STEPS + 1)]
        write_run(root / name, name, _spec(name, lr), losses)
        assert cli.main(["track", "import", str(root / name), "--state-dir", state]) == 0
    client = MlflowClient(embedded_tracking_uri(state))
    experiment = client.get_experiment_by_name("kitchen/nlp")
    assert experiment is not None
    runs = {r.info.run_name: r.info.run_id for r in client.search_runs([experiment.experiment_id])}
    port = free_port()
    with open(root / "ui.log", "wb") as log:
        proc = subprocess.Popen(ui_command(state, port), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None, (root / "ui.log").read_text()
                assert time.monotonic() < deadline, "the MLflow UI did not come up in 300 s"
                time.sleep(0.5)
        yield base, experiment.experiment_id, runs
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900"):
        options.add_argument(arg)
    # Bazel's sandbox: no writable HOME, and /dev/shm may be too small for the renderer.
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.add_argument("--disable-dev-shm-usage")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _wait_for(driver, script: str, timeout: float = 120.0):
    """The first truthy value of `script` (JavaScript) in the page."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.3)
    _screenshot(driver, "timeout.png")
    text = driver.execute_script("return document.body ? document.body.innerText : ''")
    logs = driver.get_log("browser")
    raise TimeoutError(
        f"not in the page within {timeout} s: {script}\nat {driver.current_url}, the page "
        f"says: {text[:800]!r}\nbrowser log: {logs[-10:]}"
    )


def _screenshot(driver, name: str) -> None:
    # The assistant side panel covers a third of the page: close it when it is there.
    driver.execute_script(
        "const b = document.querySelector('button[aria-label=Close]'); if (b) b.click();"
    )
    time.sleep(0.5)
    out = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
    if out:
        driver.save_screenshot(os.path.join(out, name))


# Each plotly chart with the title of its card: the card's first line of text.
CHARTS = """return Array.from(document.querySelectorAll('.js-plotly-plot')).map(p => {
  let card = p;
  while (card.parentElement && !/^[a-z]/i.test(card.innerText || '')) card = card.parentElement;
  return {title: (card.innerText || '').split('\\n')[0],
          points: (p.data || []).map(t => (t.x || []).length)};
})"""


def test_run_page_draws_every_logged_step(ui, browser):
    base, experiment, runs = ui
    run = runs["tiny-lr3e-4"]
    browser.get(f"{base}/#/experiments/{experiment}/runs/{run}/model-metrics")
    drawn = "return c.some(x => x.title === 'loss' && x.points.length) && c;"
    charts = _wait_for(browser, f"const c = (() => {{ {CHARTS} }})(); {drawn}")
    loss = [c for c in charts if c.get("title") == "loss"]
    assert len(loss) == 1, charts
    assert set(loss[0]["points"]) == {STEPS}  # each trace (points, smoothed line): every step
    titles = {c["title"] for c in charts}
    # Charts draw as they scroll into view: the first two rows, alphabetical.
    assert {"eval_loss", "lr", "mfu"} <= titles
    assert "step" not in titles  # the x axis, not a metric (it would sort before step_time)
    _screenshot(browser, "mlflow_run_page.png")


def test_compare_view_picks_the_params_that_differ(ui, browser):
    base, experiment, runs = ui
    ids = json.dumps(sorted(runs.values()))
    browser.get(f"{base}/#/compare-runs?runs={ids}&experiments={json.dumps([experiment])}")
    text = _wait_for(
        browser, "const t = document.body.innerText; return t.includes('Run details') && t;"
    )
    head = text[text.index("Parameters:") : text.index("Metrics:")]
    # MLflow preselects the params whose values differ: the run name and the learning rate of
    # the 148 params each run has (the spec, defaults applied).
    assert head.split("\n")[1:-1] == ["name", "trainer.optim.lr"], head
    assert "0.00100" in text and "0.00030" in text
    _screenshot(browser, "mlflow_compare.png")


# Each graph panel of Prometheus's classic graph page: its query, the lines Rickshaw drew and
# the legend's series names.
PROMETHEUS_PANELS = """const panels = document.querySelectorAll('[id^=graph_wrapper]');
return Array.from(panels).map(w => ({
  expr: (w.querySelector('textarea[name=expr]') || {}).value,
  lines: w.querySelectorAll('.graph_area svg path').length,
  legend: Array.from(w.querySelectorAll('.legend .label')).map(e => e.innerText)}))"""


def test_prometheus_graph_page_shows_mfu_and_step_time_of_a_running_job(tmp_path, browser):
    """A real launcher (fake trainer: no torch) runs a job for minutes; a real Prometheus
    scrapes its /metrics with Kitchen's config and rules; its graph page shows the job's MFU
    and its step time (the recording rule the dashboards use) while the job still runs."""
    cfg = harness.config(tmp_path)
    harness.behave(tmp_path, "live", step_seconds=0.5)
    (tmp_path / "prometheus").mkdir()
    with harness.started(cfg) as (launcher, client):
        job = client.submit(harness.spec("live", steps=2000))
        harness.wait_for_step(client, job.id, 2, timeout=120)
        target = f"127.0.0.1:{launcher.metrics_port}"
        with running_prometheus([target], tmp_path / "prometheus") as prometheus:
            scraping_since = time.monotonic()
            exprs = [
                f'kitchen_train_mfu_ratio{{job_id="{job.id}"}}',
                f'job_id:kitchen_train_step_duration_seconds:p50_1m{{job_id="{job.id}"}}',
            ]
            query = "&".join(
                f"g{i}.expr={urllib.parse.quote(e)}&g{i}.tab=0&g{i}.range_input=1m"
                for i, e in enumerate(exprs)
            )
            drawn = (
                f"const p = (() => {{ {PROMETHEUS_PANELS} }})(); return p.length === 2 && "
                f"p.every(x => x.lines > 0 && x.legend.some(l => l.includes('{job.id}'))) && p;"
            )
            deadline = time.monotonic() + 180
            while True:  # the rule has values after a few scrapes: reload until it draws
                browser.get(f"{prometheus}/classic/graph?{query}")
                try:
                    panels = _wait_for(browser, drawn, timeout=15)
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
                    continue
                if time.monotonic() - scraping_since > 30:  # lines of 30 s, not dots
                    break
                time.sleep(max(0.0, 31 - (time.monotonic() - scraping_since)))
            assert [p["expr"] for p in panels] == exprs
            assert client.get(job.id).state == job_pb2.RUNNING  # a running job's graph
            browser.set_window_size(1400, 1500)  # both panels in one picture
            browser.execute_script("window.scrollTo(0, 0)")
            try:
                _screenshot(browser, "prometheus_graph.png")
            finally:
                browser.set_window_size(1400, 900)
