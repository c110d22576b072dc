"""The benchmarks: one module each holding its logic, its config dataclass and its command, or, for
the two largest, one module per concept.

`scheduler`, `structured`, `quality` and `baseline_hf` each define a `*Config` dataclass (its
fields are the flags), `register(subparsers)` and `run(args)`, which `kvserve bench`
(kvserve/commands/bench.py) collects. `bench executor` is `executor` (the measurements),
`executor_report` (what it prints) and `executor_command` (its flags, `register`, `run`);
`bench serve` is `serve` (one run), `serve_config` (its flags), `configuration_runs` (one
configuration on a listening server), `kvserve_servers` (the servers it starts) and
`serve_command`. The rest are the parts `bench serve` is built from (workloads, load drivers,
report, sweep, plot), one concept each so they can be unit-tested without a server. torch loads
inside the functions that need it: registering every bench keeps `kvserve --help` light.
"""
