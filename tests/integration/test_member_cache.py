"""The registry held in memory by one watch, against a real etcd: once `current` says so, it
answers as a fresh listing does, without reading the records again."""

from __future__ import annotations

from robustrl.contracts.keys import KeySpace
from robustrl.contracts.members import MemberRecord
from robustrl.core.config import EtcdSettings
from robustrl.core.etcd_client import connect_etcd
from robustrl.core.member_cache import MemberCache
from robustrl.core.registry import Registry
from robustrl.core.session import Session
from tests.support import eventually


def rollout(n: int, job_id: str = "", epoch: int = 0) -> MemberRecord:
    return MemberRecord(
        role="rollout",
        instance_id=f"rollout-{n}",
        address=f"h:{n}",
        pid=n,
        host="h",
        job_id=job_id,
        epoch=epoch,
    )


async def test_the_cache_answers_as_the_registry_does_after_every_change(
    etcd_settings: EtcdSettings,
) -> None:
    client = await connect_etcd(etcd_settings)
    keys = KeySpace(etcd_settings.prefix)
    registry = Registry(client, keys)
    session = await Session.open(client, ttl=10)
    for n in range(5):
        await registry.register(session, rollout(n))
    cache = MemberCache(registry)
    cache.start()
    try:

        async def same() -> None:
            await eventually(cache.current, timeout=5)  # once the watch delivered the change
            assert (await cache.list())[0] == (await registry.list())[0]
            assert (await cache.list("rollout"))[0] == (await registry.list("rollout"))[0]

        await same()
        await registry.register(session, rollout(2, job_id="j", epoch=3))  # rebound
        await same()
        await registry.deregister(rollout(4))
        await same()
        # A record no release of ours wrote is left out (a listing of the registry fails on
        # it), and never holds `current` up.
        await client.put(keys.member("rollout", "odd"), b"{not a member")
        await eventually(cache.current, timeout=5)
        assert len(cache) == 4
        members, revision = await cache.list()
        assert [m.instance_id for m in members] == [f"rollout-{n}" for n in range(4)]
        assert members[2].job_id == "j" and revision > 0
        await client.delete(keys.member("rollout", "odd"))
        await same()
        # The session ends: every record under its lease goes at once.
        await session.close()
        await same()
        assert (await cache.list())[0] == []
        # Its watch stopped, it falls behind the registry and says so.
        await cache.stop()
        await registry.register(await Session.open(client, ttl=10), rollout(9))
        assert not await cache.current()
    finally:
        await cache.stop()
        await client.close()
