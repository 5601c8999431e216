"""The ``kv_transfer_params`` a kvmux prefill returns, as routers written for vLLM's
NixlConnector read them (vLLM's real Scheduler, a fake model: ``vllm_harness``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import torch

from kvmux.adapters.vllm.params import TransferParams
from kvmux.models import tiny_model
from vllm_harness import BLOCK, FakeEngine, expected_block, producer_and_consumer

pytestmark = pytest.mark.timeout(120)

NIXL_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host")


@pytest.fixture
def pd_pair() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    with producer_and_consumer(tiny_model(), {"backend": "tcp"}) as pair:
        yield pair


def test_prefill_params_carry_the_fields_nixl_routers_read_with_what_they_mean(
    pd_pair: tuple[FakeEngine, FakeEngine],
) -> None:
    producer, consumer = pd_pair
    prompt = [3 + i * 5 % 250 for i in range(2 * BLOCK + 1)]
    req = producer.add(prompt, max_tokens=1, params={"do_remote_decode": True})
    producer.run()
    params = dict(producer.result(req).kv_transfer_params)

    assert all(params.get(name) for name in NIXL_FIELDS), params
    address = producer.worker.worker_side.address()
    assert address is not None
    assert (params["remote_host"], params["remote_port"]) == (address["host"], address["port"])
    assert params["remote_request_id"] == req
    assert params["remote_num_tokens"] == len(prompt)
    assert params["tp_size"] == 1
    # The ids name the prefill's blocks that held the prompt (none reused since).
    blocks = params["remote_block_ids"]
    assert len(blocks) == 3
    for index, block in enumerate(blocks):
        n = min(BLOCK, len(prompt) - index * BLOCK)
        assert torch.equal(producer.block_values(block)[:n], expected_block(prompt, index))

    parsed = TransferParams.parse(params)
    assert parsed is not None and parsed.remote_block_ids == blocks
    decode = consumer.add(prompt, max_tokens=2, params=params)
    consumer.run(until=[decode])
    assert consumer.kv_errors == []
    assert consumer.worker.worker_side.connector.stats()["load_blocks_ok"] == 3


def test_malformed_nixl_fields_in_incoming_params_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="remote_block_ids"):
        TransferParams.parse({"do_remote_prefill": True, "remote_block_ids": "3,4"})
    with pytest.raises(ValueError, match="tp_size"):
        TransferParams.parse({"do_remote_prefill": True, "tp_size": 0})
