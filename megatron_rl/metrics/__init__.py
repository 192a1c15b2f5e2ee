"""What a run records: per-step metrics (phase timers, update and mismatch metrics, host
resources), the JSONL / TensorBoard / W&B tracker and the PNG plots of a run."""
