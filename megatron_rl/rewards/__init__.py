"""Rewards: byte tokenizer for the tiny models, reasoning-gym tasks and their verifiers,
math-verify answers, per-sample isolation of any reward function and the plug-in point.

Submodules are imported lazily by their users (``reasoning_gym`` and ``math_verify`` are only
needed when the corresponding reward is used).
"""
