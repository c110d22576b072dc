"""Harness pieces shared by the test suite and the benchmarks, shipped with the package.

`plan_driver` plays a minimal scheduler against any executor in-process;
`server_launcher` runs `kvserve serve` as a subprocess and always cleans it up;
`stream_requests` builds deterministic requests for it; `ports` finds free ports;
`tiny_checkpoints` writes random Hugging Face checkpoints of any Llama-family shape;
`waiting` polls for an event with a generous deadline (tests never sleep for one);
`scheduler_config` builds invariant-checked SchedulerConfigs for the scheduling-core tests.
"""
