"""How the event loop drives a ucxx worker: ucxx's blocking progress mode, mended so that a
process with nothing to move sleeps, and the waits, sends and control messages that go with it.

UCX's contract for waiting on a worker is progress, then arm, then wait on its epoll fd; an
arm that finds events pending answers busy and the caller progresses again. ucxx 0.52's
blocking mode (`BlockingMode`) adds a reader on that fd and arms the worker once, at the
start. Its reader callback progresses the worker but never arms it again, so after the first
message the fd stays readable and the event loop runs the callback on every turn: every
process that had moved weights once would spin for the rest of its life (docs/decisions/0108).

`install` replaces two methods of the mode:
- **The reader callback** progresses the worker, then keeps progressing it on every turn of
  the loop while UCX makes progress. Only then does it arm the worker and leave the loop to
  sleep until the fd wakes it. While the process pulls (`pulling`), it stays hot for `HOT_S`
  after the last progress: a transfer that pauses between events (a rendezvous waiting for
  its peer) finds the worker still being progressed. A holder does not need the window:
  within one host the puller moves the bytes (CMA), and the holder only hears that a bucket
  is done, so it arms at once and uses little CPU per GB it serves.
- **The watchdog.** Some completions raise no event; a receive failed by aborting its
  endpoint is one. ucxx's watchdog progressed an idle worker once a second; ours does so
  every `PROGRESS_INTERVAL`, then arms it again, so a puller leaves a holder whose record
  was withdrawn within that interval.

In this mode a coroutine that awaits a UCX request polls it on every turn of the loop (ucxx's
`wait_yield`), so a receive left posted keeps the loop busy. A holder waits for a puller's
next request, which may come seconds later or never, so it waits with `receive_message`
instead: each progress of a mended worker wakes it to check its receive, and it sleeps in
between; a parked puller's endpoint costs its holder nothing. It sends buckets with `send` for
the same reason: a polled send would keep its loop busy for the whole transfer, which the
puller's copy paces. Control messages are framed as protocol.py describes (`send_message`,
`receive_message`).

Nothing here runs unless `install` finds the mode as described: a ucxx that changed it is
left alone. `install` also replaces ucxx's connection handshake, which let UCX write into freed
memory after a connect timed out (`exchange_peer_info` says how).

On hosts without CUDA (unless ROBUSTRL_UCX_PULL_THREAD=0), a puller's endpoints live on a
second worker, progressed by a thread of its own (ucxx's 'thread' mode; `pull_context`). Within
one host UCX copies a bucket inside the progress call of the receiving worker: on the event
loop's thread the copy and the checksum of the bucket before it would take turns; on the
progress thread the copy of the next bucket runs beside the checksum of the last one, on
another core (docs/decisions/0104). Pullers wait for their requests by polling them on every
turn of their loop (ucxx's wait_yield), so a pulling process keeps two threads busy while it
pulls. The thread waits on the worker's epoll fd and wakes at least every
`PULL_THREAD_EPOLL_MS`. Holders stay on the process's worker in the mended blocking mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import struct
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

from robustrl.core.logs import get_logger
from robustrl.weights.protocol import FRAME_BYTES, FRAME_HEADER, frame_header, read_frame_header

log = get_logger(__name__)

_progressed: list[asyncio.Future[None]] = []
"""Futures resolved after the next progress of a mended worker (`_wake`)."""
_posted: list[tuple[Any, Any]] = []
"""(request, buffer) of quiet receives UCX has not completed: the buffer must outlive them."""
_handshakes: list[tuple[Any, Any]] = []
"""(request, buffer) of the handshake messages of `exchange_peer_info`, kept until completed."""
failed_handshakes = 0
"""Handshakes a listener of this process gave up (`QuietHandshakeFailures` logged them)."""


PROGRESS_INTERVAL = 0.02
"""Seconds: the longest a completion that raises no event waits to be seen."""

HOT_S = 0.005
"""Seconds a worker is still progressed on every turn of the loop after its last progress,
while the process pulls (docs/decisions/0108)."""

_pulls = 0
"""Pulls in flight in this process (`pulling`)."""

PULL_THREAD_EPOLL_MS = 20
"""Milliseconds the pulling worker's thread waits on its epoll fd before it progresses the
worker anyway (completions that raise no event, as for `PROGRESS_INTERVAL`)."""

_pull_context: Any = None
"""The process's pulling context (`pull_context`), made on first use and kept: finalizing a
ucxx context clears every event loop's progress task, the other worker's included."""


@contextlib.contextmanager
def pulling() -> Iterator[None]:
    """Keep workers hot (`HOT_S`) between events while the block runs: for receiving weights."""
    global _pulls
    _pulls += 1
    try:
        yield
    finally:
        _pulls -= 1


def pull_context(ucxx: Any) -> Any:
    """The process's context for pulling host weights: its own UCX worker, progressed by its
    own thread (see the module docstring). Its `create_endpoint` is the module's. Call it
    from the event loop, after `ucxx.init` and after this loop has progress for the
    process's worker (a listener or an endpoint made on it): a new ucxx context takes the
    loop's progress slot if the loop has none, and the other worker would never be
    progressed."""
    global _pull_context
    if _pull_context is None:
        from ucxx._lib_async.application_context import ApplicationContext

        ucxx.core._get_ctx().continuous_ucx_progress()  # the process's worker holds the slot
        context = ApplicationContext(progress_mode="thread")
        # Its endpoints must never claim a later event loop's progress slot either.
        context.continuous_ucx_progress = _progressed_by_its_thread
        context.worker.start_progress_thread(polling_mode=False, epoll_timeout=PULL_THREAD_EPOLL_MS)
        weakref.finalize(context, context.worker.stop_progress_thread)
        _pull_context = context
    return _pull_context


def _progressed_by_its_thread(event_loop: Any = None) -> None:
    """The pulling context's stand-in for ucxx's `continuous_ucx_progress`: its thread
    progresses it on every loop."""


def install() -> None:
    """Mend ucxx's blocking progress mode for every worker made after this call, and its
    connection handshake (`exchange_peer_info`). Idempotent."""
    _mend_handshake()
    from ucxx._lib_async import continuous_ucx_progress as progress

    mode: Any = progress.BlockingMode
    if getattr(mode, "_robustrl_mended", False):
        return
    if not all(hasattr(mode, name) for name in ("_arm_worker", "_progress_with_timeout")):
        return
    original_init = mode.__init__

    def init(self: Any, worker: Any, event_loop: Any, progress_timeout: float = 1.0) -> None:
        original_init(self, worker, event_loop, min(progress_timeout, PROGRESS_INTERVAL))

    mode.__init__ = init
    mode._fd_reader_callback = _on_event
    mode._progress_with_timeout = _watchdog
    mode._robustrl_mended = True


def _on_event(self: Any) -> None:
    """The worker's fd is readable: progress it, and keep at it while there is work."""
    self.worker.progress()
    _wake()
    _keep_progressing(self)


def _keep_progressing(self: Any) -> None:
    task = self.arm_task
    if task is None or task.done():
        self.arm_task = self.event_loop.create_task(_progress_until_quiet(self))


async def _progress_until_quiet(self: Any) -> None:
    """Progress on every turn of the loop until nothing has progressed (for HOT_S while the
    process pulls) and the worker arms (an arm answers busy while events are pending)."""
    active = time.monotonic()
    while True:
        worker = self.worker
        if worker is None:
            return
        now = self.last_progress_time = time.monotonic()
        if worker.progress_once():
            active = now
            while worker.progress_once():
                pass
            _wake()
        elif now - active > (HOT_S if _pulls else 0.0) and worker.arm():
            return
        await asyncio.sleep(0)


async def _watchdog(self: Any) -> None:
    """Progress a worker that nothing has progressed for an interval, and arm it again."""
    while True:
        await asyncio.sleep(self._progress_timeout)
        worker = self.worker
        if worker is None:
            return
        if time.monotonic() - self.last_progress_time < self._progress_timeout:
            continue
        self.last_progress_time = time.monotonic()
        worker.progress()
        _wake()
        if not worker.arm():
            _keep_progressing(self)


def pending_handshakes() -> int:
    """Handshake messages of this process that UCX has not finished with: a connection under
    way, or one that failed while its peer was frozen (its buffer kept for when it resumes)."""
    return sum(not request.completed for request, _ in _handshakes)


class QuietHandshakeFailures(logging.Filter):
    """ucxx logs a listener's handshake that failed as an unexpected error, at ERROR, with
    two tracebacks. Here it is expected: the peer that connected was killed (the connection is
    reset) or frozen (the wait times out) before it finished, by a chaos fault or a hung puller.
    This logs it as one line instead (`ucx.handshake_failed`, with the error's type); anything
    else ucxx logs, a failure of the handler's callback included, passes as it was."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if (
            len(args) == 2
            and "Unexpected error in listener handler" in str(args[0])
            and "exchange_peer_info" in str(args[1])  # the traceback: failed in the handshake
        ):
            global failed_handshakes
            failed_handshakes += 1
            error = sys.exc_info()[1]  # logged from its except block
            log.warning(
                "ucx.handshake_failed",
                side="listener",
                error=type(error).__name__,
                then="connection dropped",
            )
            return False
        return True


def _mend_handshake() -> None:
    """Replace ucxx's `exchange_peer_info` where its endpoints and listeners call it, if it
    still takes what ours does (a ucxx that changed it is left alone), and quiet its log of a
    handshake that failed (`QuietHandshakeFailures`)."""
    from ucxx._lib_async import application_context, listener

    ucx_log = logging.getLogger("ucx")
    if not any(isinstance(f, QuietHandshakeFailures) for f in ucx_log.filters):
        ucx_log.addFilter(QuietHandshakeFailures())

    for module in (application_context, listener):
        theirs = getattr(module, "exchange_peer_info", None)
        if theirs is None or theirs is exchange_peer_info:
            continue
        if list(inspect.signature(theirs).parameters) == [
            "endpoint",
            "msg_tag",
            "listener",
            "connect_timeout",
        ]:
            module.exchange_peer_info = exchange_peer_info


async def exchange_peer_info(
    endpoint: Any, msg_tag: int, listener: bool, connect_timeout: float = 5.0
) -> dict[str, int]:
    """ucxx's handshake of a new connection, the same messages (each side sends its tag and
    the tag's hash, the listener first), but a buffer UCX may still write into is never
    freed.

    ucxx 0.52 posts a stream receive of the peer's 16 bytes and waits for it with a timeout.
    When the peer is frozen (SIGSTOP, a hung rollout) the wait times out, the buffer is freed
    and the receive stays posted: once the peer resumes, UCX writes its 16 bytes into memory
    Python has handed out again (docs/decisions/0113). Here each buffer is kept until UCX is
    done with its request (`pending_handshakes` counts those it is not).
    """
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits

    global _handshakes
    _handshakes = [kept for kept in _handshakes if not kept[0].completed]
    fmt = "QQ"
    mine = struct.pack(fmt, msg_tag, hash64bits(msg_tag))
    theirs = bytearray(len(mine))
    steps = [(endpoint.stream_send, mine), (endpoint.stream_recv, theirs)]
    if not listener:
        steps.reverse()  # the listener sends first
    for post, buffer in steps:
        request = post(Array(buffer))
        _handshakes.append((request, buffer))
        await asyncio.wait_for(request.wait(), timeout=connect_timeout)
    peer_tag, checksum = struct.unpack(fmt, theirs)
    if checksum != hash64bits(peer_tag):
        raise RuntimeError(f"Checksum invalid! {hex(hash64bits(peer_tag))} != {hex(checksum)}")
    return {"msg_tag": peer_tag, "checksum": checksum}


def _wake() -> None:
    global _progressed, _posted
    waiting, _progressed = _progressed, []
    for future in waiting:
        if not future.done() and not future.get_loop().is_closed():
            future.set_result(None)
    if _posted:
        _posted = [posted for posted in _posted if not posted[0].completed]


async def send_message(endpoint: Any, body: bytes) -> None:
    """Send a control message (a request or a reply, framed as protocol.py says) that
    `receive_message` takes: one UCX message while the body fits in FRAME_BYTES with its
    header, two beyond.

    Where a mended worker progresses the endpoint, its sends and receives wait without
    polling: a worker's messages and errors land only when it is progressed, so each is posted
    and then checked after every progress of the worker, sleeping in between (the watchdog
    progresses at least every PROGRESS_INTERVAL). Elsewhere (a puller's thread-progressed
    worker, a ucxx this module does not know) they are ucxx's own `send` and `recv`."""
    room = FRAME_BYTES - FRAME_HEADER.size
    await send(endpoint, frame_header(len(body)) + body[:room])
    if len(body) > room:
        await send(endpoint, body[room:])


async def receive_message(endpoint: Any, limit: int) -> bytes:
    """The body of the next control message a peer sent with `send_message`. protocol.FrameError for
    anything else (ucxx's `send_obj` from a peer of another protocol, say) or a body over
    `limit` bytes; the endpoint is then out of step and should be closed."""
    frame = bytearray(FRAME_BYTES)
    await _receive(endpoint, frame)
    length = read_frame_header(frame, limit)
    start = FRAME_HEADER.size
    if start + length <= FRAME_BYTES:
        return bytes(frame[start : start + length])
    rest = bytearray(start + length - FRAME_BYTES)
    await _receive(endpoint, rest)
    return bytes(frame[start:]) + bytes(rest)


def _quiet(endpoint: Any) -> bool:
    """Whether a mended worker progresses `endpoint`, and it has the shape `send` and
    `_receive` use."""
    from ucxx._lib_async import continuous_ucx_progress as progress

    context = getattr(endpoint, "_ctx", None)
    return (
        getattr(progress.BlockingMode, "_robustrl_mended", False)
        and getattr(context, "progress_mode", None) == "blocking"
        and bool(getattr(endpoint, "_tags", None))
        and hasattr(endpoint, "_ep")
    )


async def send(endpoint: Any, buffer: Any, tag: int | None = None) -> None:
    """`endpoint.send(buffer, tag=tag)`, waiting without polling (see `send_message`): the
    send is checked after every progress of the worker. The peer receives it with ucxx's
    `recv(..., tag=tag)`."""
    if not _quiet(endpoint):
        await endpoint.send(buffer, tag=tag)
        return
    from ucxx._lib.arr import Array
    from ucxx._lib.libucxx import UCXCloseError
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag

    endpoint._ep.raise_on_error()
    if endpoint.closed:
        raise UCXCloseError("Endpoint closed")
    # ucxx mixes a user tag with the endpoint's own, as its send does.
    own = endpoint._tags["msg_send"]
    wire_tag = Tag(own if tag is None else hash64bits(own, hash(tag)))
    await _completion(endpoint._ep.tag_send(Array(buffer), wire_tag), buffer)


async def _receive(endpoint: Any, buffer: Any) -> None:
    """`endpoint.recv(buffer)` (no tag), waiting without polling where `send` does."""
    if not _quiet(endpoint):
        await endpoint.recv(buffer)
        return
    from ucxx._lib.arr import Array
    from ucxx._lib.libucxx import UCXCloseError
    from ucxx.types import Tag, TagMaskFull

    if endpoint.closed:
        raise UCXCloseError("Endpoint closed")
    request = endpoint._ep.tag_recv(Array(buffer), Tag(endpoint._tags["msg_recv"]), TagMaskFull)
    await _completion(request, buffer)


async def _completion(request: Any, buffer: Any) -> None:
    """Wait for a posted request, checking it after each progress of the worker."""
    # Held until UCX is done with the buffer, even if the waiter is cancelled first.
    _posted.append((request, buffer))
    while not request.completed:
        future = asyncio.get_running_loop().create_future()
        _progressed.append(future)
        await future
    request.check_error()
