"""The `robustrl` command line: the local stack (up/down) and a client for the coordinator."""
