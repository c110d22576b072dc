"""The scheduler service around the core, in rooms: the two APIs (`grpc_api/`, `http/`), what turns
a call into a request (`intake/`, `tools/`, `structured/`) and outputs back into a stream
(`delivery/`), the executor link (`executor_link/`), `observability/` and `security/`. Beside them,
the engine loop (`engine.py`) and the service that starts it all (`service.py`)."""
