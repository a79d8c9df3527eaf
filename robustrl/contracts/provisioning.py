"""What provisioning records and says: the members a coordinator's provisioner started
(`<prefix>/provisioned/<id>`, which `robustrl down` stops too) and the metadata key of the
Provisioning stream's acceptance."""

from __future__ import annotations

import aetcd
from pydantic import BaseModel

from robustrl.contracts.keys import KeySpace

ACCEPTED_METADATA_KEY = "robustrl-scheduler-accepted"
"""Initial metadata of a Provisioning stream whose hello was accepted (value: the name)."""


class ProvisionedRecord(BaseModel):
    """`<prefix>/provisioned/<instance_id>`: what `robustrl down` must stop as well."""

    instance_id: str
    role: str
    pid: int
    host: str
    argv: list[str]
    """Its command line as /proc shows it (`down` checks it before it stops the pid): a member
    forked from the warm template shows the template's."""
    log: str
    job_id: str
    reason: str
    at: float


async def list_provisioned(client: aetcd.Client, keys: KeySpace) -> list[ProvisionedRecord]:
    return [
        ProvisionedRecord.model_validate_json(kv.value)
        for kv in await client.get_prefix(keys.provisioned())
    ]
