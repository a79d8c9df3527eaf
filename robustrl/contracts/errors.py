"""Our exceptions, each carrying the gRPC status code it maps to.

Handlers raise these; the server interceptor turns them into statuses in one place, so no
handler deals with status codes and nothing that we anticipated escapes as UNKNOWN.
"""

from __future__ import annotations

import grpc
import pydantic


class RobustrlError(Exception):
    """Base: an error a caller can act on, with the status code it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = metadata or {}


class InvalidArgument(RobustrlError):
    """The request itself is wrong (malformed spec, bad id); retrying it will not help."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RobustrlError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RobustrlError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(RobustrlError):
    """The target is in the wrong state for this request (e.g. cancelling a finished job)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(RobustrlError):
    """Lost a compare-and-swap: someone else changed the record first; re-read and retry."""

    code = grpc.StatusCode.ABORTED


class Unavailable(RobustrlError):
    """Not served here right now (not the leader, etcd unreachable); retry, maybe elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class Fenced(RobustrlError):
    """The sender was fenced: a newer epoch of its role replaced it. Never retry."""

    code = grpc.StatusCode.FAILED_PRECONDITION


LEADER_METADATA_KEY = "robustrl-leader"


class NotLeader(Unavailable):
    """A write reached a coordinator follower. Names the leader so the client can go there."""

    def __init__(self, leader_address: str | None) -> None:
        where = f"the leader is at {leader_address}" if leader_address else "no leader elected yet"
        super().__init__(
            f"this coordinator is not the leader; {where}",
            metadata={LEADER_METADATA_KEY: leader_address or ""},
        )
        self.leader_address = leader_address


def describe_validation_error(exc: pydantic.ValidationError) -> str:
    """One line naming each invalid field by its dotted path (`trainer.lr: ...`)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "value_error":
            # A validator across fields says which one it refuses: "dtype: ..." under trainer.
            msg = msg.removeprefix("Value error, ")
            field, sep, rest = msg.partition(": ")
            if sep and all(part.isidentifier() for part in field.split(".")):
                where, msg = f"{where}.{field}" if where != "<root>" else field, rest
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)
