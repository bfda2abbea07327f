"""What makes a job spec read from etcd safe to run: the cluster key, sealed specs, refusals, RBAC."""
