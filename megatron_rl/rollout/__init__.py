"""Rollout: generation engines and sampling filters (``filters``: DAPO dynamic sampling,
overlong handling, RAGEN reward-variance top-p)."""
