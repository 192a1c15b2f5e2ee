"""The allowed values of ``teacher.mode`` and ``teacher.engine`` (no torch: the config loads
before any rank imports it; the signal is :mod:`megatron_rl.loss.distill`)."""

MODES = ("reward", "loss")
ENGINES = ("actor", "sglang")  # teacher.engine: frozen Megatron model | SGLang servers
