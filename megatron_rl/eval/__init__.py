"""Evaluation on named benchmark sets: pass@k / avg@k / maj@k (docs/evaluation.md)."""
