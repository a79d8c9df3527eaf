"""What a UCX transport counts as it pulls and serves: counts, never timings. Each part of the
transport adds to the one `TransferCounters` its transport holds; `robustrl weights` and the
tests read them."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TransferCounters:
    """What this process pulled and served."""

    buckets_by_source: Counter[str] = field(default_factory=Counter)
    bytes_by_source: Counter[str] = field(default_factory=Counter)
    checksum_failures: int = 0
    source_switches: int = 0
    source_failures: int = 0
    refusals: int = 0  # holders that answered with an error (busy, not held, ...)
    etcd_reads: int = 0  # range reads by pulls; a first look at a version seen by the watch is free
    pulls_completed: int = 0
    endpoints_opened: int = 0  # to holders, by pulls; a parked endpoint taken back is not new
    kept_endpoints_lost: int = 0  # kept endpoints the holder had hung up (KeptEndpointLost)
    buckets_served: int = 0
    bytes_served: int = 0
    requests_refused: int = 0
    records_written: int = 0  # holder records this process wrote to etcd
    pullers_checks: int = 0  # delayed looks at a pullers count, each after its write if any
    versions_kept: int = 0  # held copies a same-contents re-publish did not make us drop
    manifests_parsed: int = 0  # each distinct manifest once while kept (VersionDirectory.manifest)

    def gauges(self) -> dict[str, float]:
        """The counts a role's status carries (`weights_*`, beside WeightTransport.gauges)."""
        return {
            "weights_pulls": float(self.pulls_completed),
            "weights_checksum_failures": float(self.checksum_failures),
            "weights_source_failures": float(self.source_failures),
            "weights_source_switches": float(self.source_switches),
            "weights_refusals": float(self.refusals),
            "weights_buckets_served": float(self.buckets_served),
            "weights_bytes_served": float(self.bytes_served),
        }

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["buckets_by_source"] = dict(self.buckets_by_source)
        out["bytes_by_source"] = dict(self.bytes_by_source)
        return out
