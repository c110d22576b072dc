"""The GPU proof: one prepared, time-boxed run that checks kvserve's CUDA path and measures it.

`scripts/gpu_check.sh OUT_DIR` runs `python -m kvserve.gpu_check`: the stages of `stages.py`, each
in a subprocess of its own, then `OUT_DIR/report.json`. See docs/gpu_check.md.
"""
