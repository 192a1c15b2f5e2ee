from megatron_rl.cli import run

run()
