"""Python clients for the kvserve gRPC API (sync and asyncio). Imports only the generated stubs."""
