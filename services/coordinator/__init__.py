"""The coordinator: job specs and state in etcd, leader election, work assignment, recovery.

It never runs models and never imports torch (a test proves it).
"""
