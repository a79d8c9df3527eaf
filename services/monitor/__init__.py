"""The monitor: every role's heartbeat stream, the detectors, and the incidents they raise.

It reports what failed, with evidence and confidence; it never decides recovery. It never
imports torch (a test proves it).
"""
