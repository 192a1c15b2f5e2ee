from megatron_rl.cli.app import run

run()
