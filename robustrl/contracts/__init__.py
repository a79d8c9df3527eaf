"""What the roles share and agree on: the job spec, roles and incident kinds, ids, the records
kept in etcd (members, incidents, the work ledger, the ETTR account) and the errors each gRPC
status stands for. Plain data and pure functions; nothing here does I/O beyond decoding."""
