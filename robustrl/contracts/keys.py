"""The etcd key layout, in one place.

<prefix>/members/<role>/<instance_id>     member record (JSON), under the member's lease
<prefix>/election/coordinator/<lease hex> coordinator candidates; lowest create revision leads
<prefix>/jobs/<job_id>                    job record (JSON); writes compare its mod revision
<prefix>/incidents/<incident_id>          incident record (JSON)
<prefix>/incident-marks/<digest>          a failure some monitor recorded (its incident id), under
                                          that monitor's marks lease: no other records it again
<prefix>/work/<job_id>                    the job's work ledger (leases, trained/dropped groups)
<prefix>/dropped/<job_id>/<page>          dropped groups and take-backs moved out of the ledger
<prefix>/weights/<job_id>                 latest published weight version and where it is
<prefix>/weights/<job_id>/v/<V>/manifest  tensors, buckets and checksums of version V (UCX)
<prefix>/weights/<job_id>/v/<V>/holders/<instance>  who serves version V, under its lease
<prefix>/fences/<instance_id>             a fenced instance: everything it sends is refused
<prefix>/recovery/<job_id>/<incident_id>  what the leader did about an incident, and when
<prefix>/provisioned/<instance_id>        a process a local provisioner started (pid, host)
<prefix>/provisioning/<job_id>            when the leader last asked for the job's replacements
<prefix>/ettr/<job_id>                    the job's ETTR account (kept time, wall time, incidents)
<prefix>/rendezvous/<job_id>              where the job's trainer ranks meet (rank 0's store, the
                                          epoch), under rank 0's lease
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeySpace:
    prefix: str

    def members(self, role: str | None = None) -> bytes:
        return f"{self.prefix}/members/{role + '/' if role else ''}".encode()

    def member(self, role: str, instance_id: str) -> bytes:
        return f"{self.prefix}/members/{role}/{instance_id}".encode()

    def election(self, name: str) -> bytes:
        return f"{self.prefix}/election/{name}/".encode()

    def jobs(self) -> bytes:
        return f"{self.prefix}/jobs/".encode()

    def job(self, job_id: str) -> bytes:
        return f"{self.prefix}/jobs/{job_id}".encode()

    def incidents(self) -> bytes:
        return f"{self.prefix}/incidents/".encode()

    def incident(self, incident_id: str) -> bytes:
        return f"{self.prefix}/incidents/{incident_id}".encode()

    def incident_mark(self, digest: str) -> bytes:
        return f"{self.prefix}/incident-marks/{digest}".encode()

    def work(self, job_id: str) -> bytes:
        return f"{self.prefix}/work/{job_id}".encode()

    def dropped_pages(self, job_id: str) -> bytes:
        return f"{self.prefix}/dropped/{job_id}/".encode()

    def dropped_page(self, job_id: str, page: int) -> bytes:
        return self.dropped_pages(job_id) + f"{page:06d}".encode()

    def weights(self, job_id: str) -> bytes:
        return f"{self.prefix}/weights/{job_id}".encode()

    def fences(self) -> bytes:
        return f"{self.prefix}/fences/".encode()

    def fence(self, instance_id: str) -> bytes:
        return f"{self.prefix}/fences/{instance_id}".encode()

    def recoveries(self, job_id: str = "") -> bytes:
        return f"{self.prefix}/recovery/{job_id + '/' if job_id else ''}".encode()

    def recovery(self, job_id: str, incident_id: str) -> bytes:
        return f"{self.prefix}/recovery/{job_id}/{incident_id}".encode()

    def ettr(self, job_id: str) -> bytes:
        return f"{self.prefix}/ettr/{job_id}".encode()

    def rendezvous(self, job_id: str) -> bytes:
        return f"{self.prefix}/rendezvous/{job_id}".encode()

    def provisioned(self, instance_id: str = "") -> bytes:
        return f"{self.prefix}/provisioned/{instance_id}".encode()

    def provisioning(self, job_id: str) -> bytes:
        return f"{self.prefix}/provisioning/{job_id}".encode()


@dataclass(frozen=True)
class WeightKeys:
    """Where versions, manifests and holders live, under the shared KeySpace prefix."""

    keys: KeySpace

    def announcement(self, job_id: str) -> bytes:
        return self.keys.weights(job_id)

    def versions(self, job_id: str) -> bytes:
        return self.keys.weights(job_id) + b"/v/"

    def version(self, job_id: str, version: int) -> bytes:
        return self.versions(job_id) + f"{version:012d}/".encode()

    def manifest(self, job_id: str, version: int) -> bytes:
        return self.version(job_id, version) + b"manifest"

    def holders(self, job_id: str, version: int) -> bytes:
        return self.version(job_id, version) + b"holders/"

    def holder(self, job_id: str, version: int, instance_id: str) -> bytes:
        return self.holders(job_id, version) + instance_id.encode()

    def parse(self, job_id: str, key: bytes) -> tuple[int, str] | None:
        """(version, rest) for a key under versions(job_id), e.g. (7, 'manifest')."""
        prefix = self.versions(job_id)
        if not key.startswith(prefix):
            return None
        head, _, rest = key[len(prefix) :].decode().partition("/")
        return (int(head), rest) if head.isdigit() else None
