"""kvserve: the `kvserve` command line. The services live in scheduler_svc/ and executor_svc/."""

__version__ = "0.1.0"
