"""The CPU-only scheduler service: request state, KV block accounting, prefix cache,
continuous batching and the gRPC API. It never imports torch, triton or executor_svc."""
