"""The weight plane: how a trainer publishes a version of its weights and every other process
pulls, verifies and relays it (UCX, with a gRPC stream as fallback).

What the services use is exported here; the modules behind it are the plane's own.
"""

from robustrl.weights.transport import (
    GrpcStreamTransport,
    WeightIntegrityError,
    WeightTransport,
    latest_announcement,
)
from robustrl.weights.ucx.transport import make_transport, warm_up_ucxx

__all__ = [
    "GrpcStreamTransport",
    "WeightIntegrityError",
    "WeightTransport",
    "latest_announcement",
    "make_transport",
    "warm_up_ucxx",
]
