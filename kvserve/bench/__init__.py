"""The benchmarks: one module each, holding its logic, its config dataclass and its command.

`scheduler`, `executor`, `structured`, `quality`, `serve` and `baseline_hf` each define a
`*Config` dataclass (its fields are the flags), `register(subparsers)` and `run(args)`, which
`kvserve bench` (kvserve/commands/bench.py) collects. The rest are the parts `bench serve` is
built from (workloads, load drivers, report, sweep, plot), one concept each so they can be
unit-tested without a server. torch loads inside the functions that need it: registering every
bench keeps `kvserve --help` light.
"""
