"""The control service: elasticctl's gRPC API on the local unix socket, and what it checks."""
