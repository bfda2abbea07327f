"""A gRPC channel straight to one etcd endpoint, for the native streams (lease, watch).

One place says how the daemon reaches etcd's gRPC API: ``credentials`` reads
the store's PEM files into TLS credentials (at each new channel, so renewed
certificates are taken up), and ``channel`` opens a channel to an endpoint
URL, secure for https://, never through an http_proxy from the environment
(as the gateway client goes straight to etcd too).
"""
from __future__ import annotations

import grpc

from .base import StoreAuthError


def credentials(ca_cert: str | None, cert: str | None,
                key: str | None) -> grpc.ChannelCredentials:
    """TLS credentials for a gRPC channel to etcd, from the store's PEM files (read now)."""
    pem = [_read(path) if path else None for path in (ca_cert, cert, key)]
    return grpc.ssl_channel_credentials(root_certificates=pem[0], certificate_chain=pem[1],
                                        private_key=pem[2])


def channel(url: str, creds: grpc.ChannelCredentials | None,
            options: tuple = ()) -> grpc.Channel:
    """A channel to ``url`` (http:// or https://, with ``creds``) with gRPC ``options``."""
    target = url.split("://", 1)[-1]
    opts = [("grpc.enable_http_proxy", 0), *options]
    if url.startswith("https://"):
        if creds is None:
            raise ValueError(f"{url}: an https:// endpoint needs TLS credentials")
        return grpc.secure_channel(target, creds, opts)
    return grpc.insecure_channel(target, opts)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise StoreAuthError(f"cannot read etcd's TLS file {path}: {exc}") from None
