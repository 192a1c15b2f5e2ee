"""The allowed values of ``rollout.sglang.quantization`` and ``rollout.sglang.fp8_scale_fmt``
(no torch: the config loads before any rank imports it; the quantiser is
:mod:`megatron_rl.rollout.fp8`)."""

QUANTIZATIONS = ("fp8",)  # rollout.sglang.quantization (null: none)
SCALE_FMTS = ("float32", "ue8m0")  # float32 scales (DeepSeek-V3 / Qwen3-FP8) or UE8M0 (V3.1)
