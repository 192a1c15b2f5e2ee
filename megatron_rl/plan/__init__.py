"""The memory and step-time planner behind ``python -m megatron_rl plan``: does a config fit its
GPUs, and at which TP x PP x DP layout (docs/planning.md)."""
