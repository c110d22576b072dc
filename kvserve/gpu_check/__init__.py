"""The GPU proof: one prepared run that checks kvserve's CUDA path and measures it (issue 14).

`scripts/gpu_check.sh OUT_DIR` installs the wheels carried in `.gpu-wheels/`, then runs
`python -m kvserve.gpu_check`, which runs the checks stage by stage, each stage in a
subprocess of its own (a CUDA fault or a hang ends one stage, never the run), and writes
`OUT_DIR/report.json`. `--dry-run` checks the plumbing on any machine in seconds.

The orchestrating modules (registry, results, wheel_list, report, orchestrator) use the
standard library only, so the dry run needs nothing installed; the check modules import
torch and the services inside their stage processes. See docs/gpu_check.md.
"""
