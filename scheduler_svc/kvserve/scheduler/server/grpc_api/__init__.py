"""The gRPC API: the `KVServe` service, its strict request decoding, health and server reflection."""
