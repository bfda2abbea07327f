"""What the daemon serves over HTTP: the Prometheus endpoint (endpoint)."""
