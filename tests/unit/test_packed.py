"""The codec of the records the coordinator rewrites on every request (contracts.packed)."""

from __future__ import annotations

import zlib

import pytest

from robustrl.contracts import packed
from robustrl.contracts.ettr import EttrAccount
from services.coordinator import work


def busy_ledger() -> work.WorkLedger:
    """A ledger as a job with 16 rollouts leaves it: 128 groups out, half of them delivered."""
    ledger = work.WorkLedger(job_id="grpo-demo-7f3a")
    for r in range(16):
        work.lease(
            ledger,
            instance_id=f"rollout-{r}-8c1d2e",
            epoch=3,
            max_groups=8,
            budget=256,
            now=1795645845.0 + r * 0.173,
            lease_seconds=60,
        )
    for r in range(8):
        mine = [g for g, lease in ledger.open.items() if lease.instance_id == f"rollout-{r}-8c1d2e"]
        work.complete(ledger, f"rollout-{r}-8c1d2e", mine)
    return ledger


def test_a_stored_ledger_is_a_fraction_of_its_json_and_loads_back_equal() -> None:
    ledger = busy_ledger()
    stored = packed.dump(ledger)
    assert packed.load(work.WorkLedger, stored) == ledger
    # What etcd keeps per rewrite: the point of compressing.
    assert len(stored) * 6 < len(ledger.model_dump_json())


def test_records_stored_as_plain_json_still_load() -> None:
    """Written before records were compressed, or put by hand with etcdctl."""
    ledger = busy_ledger()
    account = EttrAccount(started_at=12.5)
    assert packed.load(work.WorkLedger, ledger.model_dump_json().encode()) == ledger
    assert packed.load(EttrAccount, b"  " + account.model_dump_json().encode()) == account


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"not a record", "neither JSON nor zlib"),
        (zlib.compress(b'{"job_id": "x", "next_index": 4}')[:-6], "truncated"),
        (zlib.compress(b" " * (packed.MAX_JSON_BYTES + 1)), "decompresses to over"),
        (zlib.compress(b'{"next_index": 4}'), "job_id"),  # valid zlib, not a ledger
    ],
)
def test_a_value_that_is_no_record_fails_with_a_clear_error(raw: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        packed.load(work.WorkLedger, raw)


def test_the_json_of_a_value_as_etcdctl_prints_it() -> None:
    """etcdctl --print-value-only ends the value with a newline; the chaos tests read it so."""
    ledger = busy_ledger()
    printed = packed.dump(ledger) + b"\n"
    assert packed.json_of(printed) == ledger.model_dump_json().encode()
    assert packed.json_of(b'{"a": 1}\n') == b'{"a": 1}\n'
