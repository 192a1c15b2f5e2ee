"""The RL run: the loop (:mod:`megatron_rl.run.trainer`), rank 0's rollout driver, what a run
is built from (setup, initial weights, SFT warm start), colocation hand-offs, the run directory's
guard rails, input checks, checkpoint export and the non-RL jobs (eval, sft)."""
