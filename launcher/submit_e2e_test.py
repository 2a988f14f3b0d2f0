"""The README's main command with the real trainer: `submit` starts an embedded launcher,
which runs `//trainer:train` (found in the runfiles, or `python -m trainer.main` outside
Bazel) on a small pretraining job to the end. About 20-40 s on two CPU cores."""

import math
import os
import subprocess
import sys

from protos.progress_log import read_progress_log

CONFIG = """\
name: e2e
kind: pretrain
trainer:
  data: {seq_len: 64, vocab_size: 512, max_documents: 200}
  model: {dim: 64, n_layers: 2, n_heads: 4}
  train: {steps: 12, micro_batch: 4, log_every: 2, eval_every: 0}
  checkpoint: {every_steps: 6}
"""


def test_submit_runs_the_real_trainer_to_the_end(tmp_path):
    config = tmp_path / "e2e.yaml"
    config.write_text(CONFIG)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "OMP_NUM_THREADS": "2",
        "KITCHEN_STATE_DIR": str(tmp_path / "state"),
    }
    cmd = [sys.executable, "-m", "launcher.submit", "--config", str(config)]
    done = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=240)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "j1 SUCCEEDED" in out
    final = next(line for line in out.splitlines() if line.strip().startswith("final loss"))
    final_loss = float(final.split()[2])
    assert math.isfinite(final_loss) and final_loss < math.log(512)  # learned something
    run = tmp_path / "state" / "runs" / "j1"
    assert (run / "checkpoints" / "step_00000012").is_dir()
    assert (run / "loss.png").exists()
    train = [p for p in read_progress_log(run).records if p.phase == "train"]
    assert train and train[-1].step == 12 and train[-1].job_id == "j1"
    assert (tmp_path / "state" / "precook").is_dir()  # KITCHEN_STATE_DIR reached the trainer
