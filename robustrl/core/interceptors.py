"""Server interceptors: map our exceptions to gRPC status codes, log and count every call.

This is the one place where exceptions become statuses. A handler raises a `RobustrlError`
(or pydantic's ValidationError for bad input); anything else escaping a handler is a bug,
is logged as `grpc.unhandled`, and reaches the client as UNKNOWN.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pydantic
from prometheus_client import Counter, Histogram

from robustrl.contracts.errors import RobustrlError, describe_validation_error
from robustrl.core.etcd_client import ETCD_UNREACHABLE, etcd_out_of_space
from robustrl.core.logs import get_logger

log = get_logger(__name__)

RPCS = Counter("robustrl_rpcs_total", "RPCs handled", ["method", "code"])
RPC_SECONDS = Histogram("robustrl_rpc_seconds", "RPC handling time (unary calls)", ["method"])

REPEAT_WINDOW_S = 10.0
"""A failure logged for one method, status and reason is not logged again for this long; the
next one logged says how many were not (`unlogged`). Every one is counted (RPCS)."""


class Repeats:
    """Which of many equal log lines to write. Through an etcd outage every rollout's lease
    failed the same way several times a second, each logged: thousands of equal lines a minute
    on a large job."""

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self._seen: dict[tuple[str, ...], tuple[float, int]] = {}  # -> (logged at, unlogged)

    def admit(self, key: tuple[str, ...]) -> int | None:
        """None: leave this one out; else how many were left out since the last one logged."""
        now = self.clock()
        if len(self._seen) > 4096:  # forget keys not seen for a window: bounded memory
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window}
        logged_at, unlogged = self._seen.get(key, (float("-inf"), 0))
        if now - logged_at < self.window:
            self._seen[key] = (logged_at, unlogged + 1)
            return None
        self._seen[key] = (now, 0)
        return unlogged


_failures = Repeats(REPEAT_WINDOW_S)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, dict[str, str]] | None:
    if isinstance(exc, RobustrlError):
        return exc.code, exc.message, exc.metadata
    if isinstance(exc, pydantic.ValidationError):
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid field " + describe_validation_error(exc),
            {},
        )
    if isinstance(exc, ETCD_UNREACHABLE):
        return grpc.StatusCode.UNAVAILABLE, f"etcd unreachable, retry later ({exc})", {}
    if etcd_out_of_space(exc):
        # Every client rides out UNAVAILABLE; the leader frees etcd within seconds.
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"etcd is out of space (NOSPACE) and takes no write until it is freed, retry later "
            f"({exc})",
            {},
        )
    return None


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    mapped = _status_of(exc)
    if mapped is None:
        RPCS.labels(method, "UNKNOWN").inc()
        log.error("grpc.unhandled", method=method, exc_info=exc)
        raise exc
    code, message, metadata = mapped
    RPCS.labels(method, code.name).inc()
    if code is grpc.StatusCode.INVALID_ARGUMENT or code is grpc.StatusCode.NOT_FOUND:
        log.info("grpc.rejected", method=method, code=code.name, reason=message)
    elif (unlogged := _failures.admit((method, code.name, message))) is not None:
        log.warning("grpc.failed", method=method, code=code.name, reason=message, unlogged=unlogged)
    if metadata:
        context.set_trailing_metadata(tuple(metadata.items()))
    await context.abort(code, message)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method: str = details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            response = await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, method, exc)
            raise  # unreachable: abort raises
        finally:
            RPC_SECONDS.labels(method).observe(time.perf_counter() - started)
        RPCS.labels(method, "OK").inc()
        return response

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, method, exc)
            raise
        RPCS.labels(method, "OK").inc()

    return wrapped
