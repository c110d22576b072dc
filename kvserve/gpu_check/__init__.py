"""The GPU proof: one time-boxed run that checks kvserve's CUDA path and measures it (docs/gpu_check.md)."""
