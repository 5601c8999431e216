"""Publications on the pool backends: holds, their counters and the renew/release messages."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from kvmux.connector import Connector
from kvmux.errors import InvalidRequestError
from kvmux.keys import BlockKey
from kvmux.net.messages import MAX_LEASES_PER_NOTICE, PEER_PROTOCOL, Release, Renew
from kvmux.publications import Publications, new_lease_id
from kvmux.registry import create_connector
from kvmux.slots import PinnedSlots
from kvmux.testing.peer import empty_caches, make_caches, make_layout

from support import keys, wait_until

BLOCKS = 8
POOL_BLOCKS = 4


def _open(backend: str, caches: dict[str, torch.Tensor], **config: Any) -> Connector:
    block = make_layout(caches).block_nbytes
    conn = create_connector(
        {"backend": backend, "timeout_s": 2.0, "capacity_bytes": POOL_BLOCKS * block, **config}
    )
    conn.register(make_layout(caches), caches)
    return conn


@pytest.fixture(params=["tcp", "shm"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Connector, Connector]]:
    producer = _open(request.param, make_caches(3, BLOCKS))
    consumer = _open(request.param, empty_caches(BLOCKS))
    yield producer, consumer
    consumer.close()
    producer.close()


def _counts(conn: Connector) -> dict[str, float]:
    stats = conn.stats()
    return {k: stats[k] for k in stats if "leases" in k}


def test_the_producer_counts_published_extended_released_and_expired_leases(
    pair: tuple[Connector, Connector],
) -> None:
    producer, consumer = pair
    source = producer.address()
    ks = keys(3)
    assert producer.save(ks, [0, 1, 2]).result().ok
    slow, done, gone = new_lease_id(), new_lease_id(), new_lease_id()
    producer.publish(ks[:1], slow, lease_s=30.0)
    producer.publish(ks[1:2], done, lease_s=30.0)
    producer.publish(ks[2:], gone, lease_s=0.2)
    assert _counts(producer)["published_leases"] == 3
    assert producer.stats()["pinned_blocks"] == 3
    consumer.renew([slow], source)
    consumer.unpublish([done], source)
    wait_until(lambda: _counts(producer)["leases_released"] == 1, 5.0)
    wait_until(lambda: _counts(producer)["leases_extended"] == 1, 5.0)
    time.sleep(0.3)
    assert _counts(producer) == {
        "published_leases": 1,
        "leases_published": 3,
        "leases_extended": 1,
        "leases_released": 1,
        "leases_expired": 1,
    }
    assert producer.stats()["pinned_blocks"] == 1
    consumer.unpublish([slow, gone, new_lease_id()], source)  # an expired and an unknown one
    wait_until(lambda: _counts(producer)["published_leases"] == 0, 5.0)
    assert _counts(producer)["leases_released"] == 2
    assert producer.stats()["pinned_blocks"] == 0
    assert "lease_notice_errors" not in consumer.stats()


def test_a_release_ends_the_hold_but_keeps_the_blocks_loadable(
    pair: tuple[Connector, Connector],
) -> None:
    producer, consumer = pair
    ks = keys(2)
    assert producer.save(ks, [0, 1]).result().ok
    lease = new_lease_id()
    producer.publish(ks, lease, lease_s=30.0)
    consumer.unpublish([lease], producer.address())
    wait_until(lambda: producer.stats()["published_leases"] == 0, 5.0)
    assert consumer.lookup(ks, producer.address()) == 2
    assert consumer.load(ks, [4, 5], producer.address()).result(timeout=5).ok


def test_a_pool_full_of_published_blocks_fails_new_saves_and_frees_them_on_release() -> None:
    caches = make_caches(5, BLOCKS)
    producer = _open("tcp", caches)
    try:
        held = keys(POOL_BLOCKS, "held")
        assert producer.save(held, range(POOL_BLOCKS)).result().ok
        lease = new_lease_id()
        producer.publish(held, lease, lease_s=30.0)
        more = producer.save(keys(2, "more"), [4, 5]).result()
        assert [o.status.value for o in more.outcomes] == ["failed"] * 2
        assert "published" in (more.outcomes[0].reason or "")
        producer.unpublish([lease])  # source None: this instance's own publication
        assert producer.save(keys(2, "more"), [4, 5]).result().ok
        assert producer.stats()["leases_released"] == 1
    finally:
        producer.close()


def test_telling_a_hung_producer_never_blocks_the_consumer() -> None:
    """A listener nobody serves: the kernel accepts, nothing ever answers."""
    consumer = _open("tcp", empty_caches(BLOCKS))
    try:
        with socket.create_server(("127.0.0.1", 0)) as mute:
            source = {"host": "127.0.0.1", "port": mute.getsockname()[1]}
            started = time.monotonic()
            for _ in range(5):
                consumer.renew([new_lease_id()], source)
                consumer.unpublish([new_lease_id()], source)
            assert time.monotonic() - started < 0.5
            wait_until(lambda: consumer.stats().get("lease_notice_errors", 0) >= 1, 10.0)
    finally:
        consumer.close()


def test_malformed_lease_ids_and_lease_lengths_are_refused(
    pair: tuple[Connector, Connector],
) -> None:
    producer, consumer = pair
    with pytest.raises(InvalidRequestError, match="32 lowercase hex"):
        producer.publish(keys(1), "not-a-lease", lease_s=1.0)
    with pytest.raises(InvalidRequestError, match="lease_s must be positive"):
        producer.publish(keys(1), new_lease_id(), lease_s=0)
    with pytest.raises(InvalidRequestError, match="32 lowercase hex"):
        consumer.unpublish(["ABC"], producer.address())


def test_renew_and_release_messages_take_only_lease_ids_and_a_bounded_number() -> None:
    lease = new_lease_id()
    msg = PEER_PROTOCOL.validate_json(Release(leases=[lease]).model_dump_json())
    assert isinstance(msg, Release) and msg.leases == [lease]
    for bad in (["../etc"], [], [lease] * (MAX_LEASES_PER_NOTICE + 1)):
        with pytest.raises(ValidationError):
            Renew(leases=bad)


def test_a_long_release_list_is_split_into_several_messages(
    pair: tuple[Connector, Connector],
) -> None:
    producer, consumer = pair
    ks = keys(1)
    assert producer.save(ks, [0]).result().ok
    leases = [new_lease_id() for _ in range(MAX_LEASES_PER_NOTICE + 5)]
    producer.publish(ks, leases[-1], lease_s=30.0)
    consumer.unpublish(leases, producer.address())
    wait_until(lambda: producer.stats()["leases_released"] == 1, 5.0)


# ------------------------------------------------------------------ the table


def _rows(*slots: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.array(slots, dtype=np.int64)


def test_publishing_a_lease_again_replaces_its_rows() -> None:
    slots, table = PinnedSlots(4), Publications()
    table.publish(slots, "a" * 32, _rows(0, 1), 10.0, now=0.0)
    table.publish(slots, "a" * 32, _rows(2), 10.0, now=0.0)
    assert slots.pinned == 1 and len(table) == 1
    assert table.release(slots, ["a" * 32]) == 1 and slots.pinned == 0


def test_an_expired_lease_is_not_brought_back_by_a_late_renewal() -> None:
    slots, table = PinnedSlots(4), Publications()
    table.publish(slots, "b" * 32, _rows(0), 1.0, now=0.0)
    assert table.renew(["b" * 32], now=0.5) == 1  # now expires at 1.5
    assert table.renew(["b" * 32], now=2.0) == 0
    table.reap(slots, now=2.0)
    assert table.counts()["leases_expired"] == 1 and slots.pinned == 0


def test_a_key_shared_by_two_publications_stays_pinned_until_both_end() -> None:
    slots, table = PinnedSlots(4), Publications()
    key = BlockKey(b"k" * 16, "ns")
    slot = slots.allocate(key, set())
    assert slot is not None
    table.publish(slots, "c" * 32, _rows(slot), 10.0, now=0.0)
    table.publish(slots, "d" * 32, _rows(slot), 10.0, now=0.0)
    table.release(slots, ["c" * 32])
    assert slot in slots.protected()
    table.release(slots, ["d" * 32])
    assert slot not in slots.protected()


def test_a_multi_passes_publications_to_its_children_and_its_address_parts() -> None:
    caches = make_caches(9, BLOCKS)
    block = make_layout(caches).block_nbytes
    tcp = {"backend": "tcp", "timeout_s": 2.0, "capacity_bytes": POOL_BLOCKS * block}
    config = {"backend": "multi", "policy": "fallback", "children": [{"backend": "cpu"}, tcp]}
    producer, consumer = create_connector(config), create_connector(config)
    try:
        producer.register(make_layout(caches), caches)
        consumer.register(make_layout(caches), empty_caches(BLOCKS))
        ks = keys(2)
        assert producer.save(ks, [0, 1]).result().ok
        lease = new_lease_id()
        producer.publish(ks, lease, lease_s=30.0)
        stats = producer.stats()
        assert stats["child.0.backend.published_leases"] == 1  # the cpu child's own
        assert stats["child.1.backend.published_leases"] == 1
        address = producer.address()
        assert address is not None
        consumer.unpublish([lease], address)
        wait_until(lambda: producer.stats()["child.1.backend.leases_released"] == 1, 5.0)
        assert producer.stats()["child.0.backend.published_leases"] == 1  # not reachable
    finally:
        consumer.close()
        producer.close()
