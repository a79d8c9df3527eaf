"""What every service shares: config, logs, the gRPC bootstrap, the etcd layer, heartbeats."""
