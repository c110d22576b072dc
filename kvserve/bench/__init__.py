"""The serving benchmark: workloads, a load driver, baselines and the report.

`kvserve bench serve` (kvserve/commands/bench_serve.py) wires these together; each module
here holds one concept so it can be unit-tested without a server.
"""
