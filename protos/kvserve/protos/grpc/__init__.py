"""Standard gRPC protocols that the installed grpcio packages do not ship (see reflection/v1/)."""
