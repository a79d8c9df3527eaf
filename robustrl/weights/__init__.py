"""The weight plane: how a trainer publishes a version of its weights and every other process
pulls, verifies and relays it (UCX, with a gRPC stream as fallback).

What the services use is exported here; the modules behind it are the plane's own:

    transport.py    the interface every transport implements (WeightTransport, Announcement,
                    WeightIntegrityError, PullProgress)
    protocol.py     the manifest, buckets, holder records and UCX messages: the wire format
    checksums/      bucket checksum algorithms by name, and checking buckets as they land
    grpc_stream.py  the gRPC stream transport: the fallback, and the benchmarks' baseline
    ucx/            the UCX transport (ucx/transport.py maps its parts)
"""

from robustrl.weights.grpc_stream import GrpcStreamTransport
from robustrl.weights.transport import (
    LocalSource,
    WeightIntegrityError,
    WeightTransport,
    latest_announcement,
)
from robustrl.weights.ucx.transport import make_transport, warm_up_ucxx

__all__ = [
    "GrpcStreamTransport",
    "LocalSource",
    "WeightIntegrityError",
    "WeightTransport",
    "latest_announcement",
    "make_transport",
    "warm_up_ucxx",
]
