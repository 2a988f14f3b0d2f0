"""4 ranks under torchrun in two expert groups of 2 (experts sharded within a group, replicated
across the two, data parallel over all four) match 1 process with 4 micro-batches; with the
aux-loss-free bias balancing, whose per-step load is summed over every rank."""

from trainer.testing import assert_same_run, final_weights, moe_job, run_trainer, torchrun

MOE = {"moe_experts": 4, "moe_top_k": 2}


def test_four_ranks_in_two_expert_groups_match_one_process(tmp_path):
    root = tmp_path
    single = run_trainer(
        "--config",
        moe_job(root, "single4", "AUX_FREE_BIAS", MOE, grad_accum=4),
        "--run-dir",
        root / "single4",
        timeout=600,  # a loaded 2-core machine: minutes, not seconds
    )
    assert single.returncode == 0, single.stdout + single.stderr
    job = moe_job(root, "ep4", "AUX_FREE_BIAS", MOE, parallelism="EXPERT", expert_parallel=2)
    result = torchrun(job, root / "ep4", nproc=4)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_run(root / "single4", root / "ep4")
    # The selection bias moved (balancing happened) and every replica agreed on it.
    bias = final_weights(root / "ep4")["layers.0.feed_forward.router.expert_bias"]
    assert bias.abs().sum() > 0
