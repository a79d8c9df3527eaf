"""UCX listeners that outlive the transports they serve: a transport borrows one and gives it
back; none is ever closed.

ucxx 0.52 keeps a listener's callback data (a dict) in its Python listener object and gives UCX
only a raw pointer to it. `Listener.close()` frees that object, but the C++ listener lives on
while any endpoint it accepted lives (each keeps it as its parent, and ucxx keeps endpoints
referenced after they are aborted), and UCX still takes connections on its port. The next
connection request would then read the freed dict (docs/decisions/0113).

So a transport takes a `ListeningPort` with `borrow` and returns it with `give_back`. A port
given back answers connections by aborting them (the puller sees a source that left and tries
another holder) until a transport on the same event loop borrows it again. A process thus has
as many listeners as it ever had transports open at once on one loop. Ports made on an event
loop that has closed stay referenced too: they cannot serve again (ucxx hands their
connections to that loop), but freeing them is what this module avoids.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

Serve = Callable[[Any], Awaitable[None]]
"""What handles one accepted endpoint: a transport's `HolderServer.serve`."""

ABORT_NS = 500_000_000
"""Nanoseconds aborting an endpoint may wait for its operations in flight (the transport's
endpoints too): bounded, so a frozen peer cannot hold the event loop for long."""


class ListeningPort:
    """One ucxx listener and whoever serves on it now (None: nobody, connections aborted)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, serve: Serve) -> None:
        self.loop = loop
        self.serve: Serve | None = serve
        self.listener: Any = None  # referenced for the process's life: the point of this module

    @property
    def port(self) -> int:
        return int(self.listener.port)

    async def accept(self, endpoint: Any) -> None:
        serve = self.serve
        if serve is None:
            with contextlib.suppress(Exception):
                endpoint.abort(period=ABORT_NS)
            return
        await serve(endpoint)


_ports: list[ListeningPort] = []
"""Every listening port this process made, in use or not: kept for the process's life."""


def borrow(ucxx: Any, serve: Serve, port: int = 0) -> ListeningPort:
    """A listening port for `serve` on the running event loop: one given back earlier (on
    `port` if it is not 0), else a new listener. Raises what ucxx raises when it cannot
    listen (e.g. the port is taken)."""
    loop = asyncio.get_running_loop()
    for slot in _ports:
        if slot.serve is None and slot.loop is loop and port in (0, slot.port):
            slot.serve = serve
            return slot
    slot = ListeningPort(loop, serve)
    slot.listener = ucxx.create_listener(slot.accept, port=port or None)
    _ports.append(slot)
    return slot


def give_back(slot: ListeningPort) -> None:
    """Stop serving on slot: connections from now on are aborted until it is borrowed again."""
    slot.serve = None
