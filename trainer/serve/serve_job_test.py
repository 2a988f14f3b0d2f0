"""`kind: serve` as a real trainer process on a checkpoint trained here: its seeded sampled
answer is the `generate` job's (the draws follow the whole distribution: a barely trained
model's greedy text hardly depends on its context, sampling does), SIGTERM lets an open request
finish before the job exits 75, and a dead engine process makes the job exit 1 (the launcher's
retry policy restarts it)."""

import os
import signal
from pathlib import Path

import openai

from protos.exit_codes import ExitCode
from trainer import testing
from trainer.serve.testing import wait_for_endpoint

PROMPT = "def "


def test_serve_job_answers_like_the_generate_job_and_drains_on_sigterm(tmp_path):
    cache = tmp_path / "cache"
    train = testing.write_job(tmp_path / "train.yaml", testing.tiny_job(cache, steps=4))
    # Timeouts for a loaded machine: three trainer processes start here (torch imports).
    trained = testing.run_trainer("--config", train, "--run-dir", tmp_path / "run", timeout=300)
    assert trained.returncode == 0, trained.stderr
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    sampling = {"prompt": PROMPT, "max_new_tokens": 30, "temperature": 0.9, "top_k": 20}
    sampling |= {"top_p": 0.9, "seed": 7}
    gen = testing.tiny_job(cache, kind="GENERATE", checkpoint={"path": str(checkpoint)})
    gen["trainer"]["generate"] = sampling
    done = testing.run_trainer(
        "--config", testing.write_job(tmp_path / "gen.yaml", gen), timeout=300
    )
    assert done.returncode == 0, done.stderr

    serve = testing.tiny_job(cache, kind="SERVE", checkpoint={"path": str(checkpoint)})
    serve["name"] = "tiny-serve"
    serve["trainer"]["serve"] = {"heartbeat_seconds": 0.5}
    log = tmp_path / "serve.log"
    config = testing.write_job(tmp_path / "serve.yaml", serve)
    process = testing.start_trainer("--config", config, "--run-dir", tmp_path / "s", log_path=log)
    try:
        endpoint = wait_for_endpoint(log, process, timeout=300)
        client = openai.OpenAI(base_url=endpoint + "/v1", api_key="-", max_retries=0)
        got = client.completions.create(
            model="tiny-serve",
            prompt=PROMPT,
            max_tokens=30,
            temperature=0.9,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": 20},
        )
        assert PROMPT + got.choices[0].text in done.stdout  # the generate job printed it
        stream = client.completions.create(
            model="tiny-serve", prompt=PROMPT, max_tokens=40, temperature=1.0, seed=1, stream=True
        )
        first = next(iter(stream))
        process.send_signal(signal.SIGTERM)  # mid-request: the answer still completes
        chunks = [first, *stream]
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert process.wait(timeout=60) == ExitCode.PREEMPTED
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "stopped (drained); 2 requests served" in text, text

    log = tmp_path / "crash.log"
    process = testing.start_trainer("--config", config, "--run-dir", tmp_path / "c", log_path=log)
    try:
        wait_for_endpoint(log, process, timeout=300)
        os.kill(engine_process(process.pid), signal.SIGKILL)  # a crash, the OOM killer
        assert process.wait(timeout=60) == ExitCode.FAILED
    finally:
        if process.poll() is None:
            process.kill()
    assert "error: the serve engine process exited with code -9" in log.read_text()


def engine_process(pid: int) -> int:
    """The serve job's engine process: its child started by multiprocessing's spawn (not the
    resource tracker spawn also starts)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"process {pid} has no engine process")
