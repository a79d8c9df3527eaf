"""The control-plane machinery every service runs on: etcd sessions, the registry, elections
and watches; the gRPC bootstrap, interceptors and channels; the process runtime; settings and
logs. It never imports torch (a test proves it)."""
