"""Edges of the RPC contract: TakeEvents never skips what it could not deliver, an undecodable or
refused request changes nothing, a batch above the send limit ends the stream naming its seq, an
epoch of another server is FAILED_PRECONDITION, a prompt the pool can never hold is refused at
registration, and a preset's max_model_len is lowered to what the pool holds."""

from __future__ import annotations

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVServiceError
from tests.service.helpers import FULL_SLIDING

pytestmark = pytest.mark.timeout(60)


async def test_take_events_never_skips_batches_it_could_not_deliver(start_kv_server, connect):
    """A TakeEvents answer larger than the send limit fails; the consumer's cursor must not have
    moved past the batches nobody received (today: they are skipped silently)."""
    running = await start_kv_server(num_blocks=512, max_model_len=2048, max_message_bytes=32 * 1024)
    client = await connect(running)
    start = (await client.take_events(pb.TakeEventsRequest(consumer="router"))).next_seq
    for i in range(10):
        prompt = [2**30 + 5000 * i + t for t in range(1000)]
        await client.get_computed_blocks(f"r{i}", prompt)
        assert (await client.allocate_slots(f"r{i}", 1000)).allocated
        await client.free(f"r{i}")
    head = running.event_log.head_seq
    delivered: list[int] = []
    try:
        delivered += [b.seq for b in (await client.take_events(pb.TakeEventsRequest(consumer="router"))).batches]
    except KVServiceError as err:  # allowed: the answer does not fit; then nothing may be lost
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    while True:
        batches = (await client.take_events(pb.TakeEventsRequest(consumer="router", max_batches=1))).batches
        if not batches:
            break
        delivered += [b.seq for b in batches]
    assert delivered == list(range(start, head + 1))


@pytest.mark.parametrize(
    "method, payload",
    [
        ("GetComputedBlocks", b"\x0a\x02\xff\xfe\x12\x01\x05"),  # request_id is not UTF-8
        ("Step", b"\x0a\x05\xff\xff\xff\xff\xff"),  # truncated / corrupt wire format
    ],
)
async def test_undecodable_request_is_invalid_argument_and_changes_nothing(kv_server, client, method, payload):
    before = await client.get_usage()
    async with grpc.aio.insecure_channel(kv_server.address) as channel:
        call = channel.unary_unary(f"/kvservice.v1.KVCacheService/{method}")  # bytes in, bytes out
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(payload, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "<class" not in err.value.details()  # no Python internals in the status
    assert await client.get_usage() == before


async def test_allocate_slots_answering_not_allocated_changes_nothing(start_kv_server, connect):
    """proto: AllocateSlotsResponse.allocated 'False when the pool has too few free blocks; then
    nothing changed'. With a sliding-window group, today the blocks outside the window are freed
    anyway (num_free_blocks and the block table change). Either keep the contract or document it."""
    running = await start_kv_server(**FULL_SLIDING, block_size=16, num_blocks=400, max_model_len=131072)
    client = await connect(running)
    await client.get_computed_blocks("a", list(range(1, 3001)))
    assert (await client.allocate_slots("a", 3000)).allocated
    free = (await client.get_usage()).num_free_blocks
    n = (free // 2 - 1) * 16
    await client.get_computed_blocks("b", list(range(10_000, 10_000 + n)))
    assert (await client.allocate_slots("b", n)).allocated
    before = await client.get_usage()
    table = running.engine.manager.get_block_ids("a")
    result = await client.allocate_slots("a", 1, new_token_ids=[5], num_lookahead_tokens=2000)
    assert not result.allocated
    assert await client.get_usage() == before
    assert running.engine.manager.get_block_ids("a") == table


async def test_a_batch_above_the_send_limit_ends_the_stream_naming_its_seq(start_kv_server, connect):
    running = await start_kv_server(num_blocks=1024, max_model_len=4096, max_message_bytes=8192)
    client = await connect(running)
    stream = client.stream_events(start_seq=1)
    prompt = [t % 100 for t in range(3500)]  # 3.5 KB of request; its BlockStored is ~11 KB
    await client.get_computed_blocks("big", prompt)
    assert (await client.allocate_slots("big", 3500)).allocated
    with pytest.raises(KVServiceError) as err:
        await anext(aiter(stream))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "batch seq 1 is" in err.value.message and "above max_message_bytes 8192" in err.value.message
    assert "last seq delivered 0" in err.value.message
    # TakeEvents says the same and does not move the consumer past it.
    with pytest.raises(KVServiceError) as take_err:
        await client.take_events("c", start_seq=1)
    assert take_err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "batch seq 1 is" in take_err.value.message
    assert running.event_log.consumer_cursor("c") is None


async def test_take_events_with_an_epoch_of_another_server_is_failed_precondition(kv_server, client):
    with pytest.raises(KVServiceError) as err:
        await client.take_events("c", epoch="not-this-one")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "'not-this-one'" in err.value.message
    assert (await client.take_events("c", epoch=kv_server.event_log.epoch)).next_seq == 1


async def test_a_prompt_the_pool_can_never_hold_is_refused_at_registration(start_kv_server, connect):
    # 16 blocks of 4 tokens (null block aside: 60 tokens) below max_model_len 64.
    running = await start_kv_server()
    assert any("at most 60 tokens, below max_model_len 64" in note for note in running.notes)
    client = await connect(running)
    before = await client.get_usage()
    with pytest.raises(KVServiceError) as err:
        await client.get_computed_blocks("r", list(range(61)))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids: length 61 needs at least 16 blocks at once; the pool has 15" in err.value.message
    assert await client.get_usage() == before and not running.engine.requests
    assert (await client.get_computed_blocks("r", list(range(60)))).num_computed_tokens == 0


async def test_a_preset_max_model_len_is_lowered_to_what_the_pool_holds(start_kv_server):
    running = await start_kv_server(preset="llama-3-8b", block_size=16, num_blocks=512, max_model_len=None)
    assert running.engine.max_model_len == 511 * 16 == running.config.cache.max_model_len
    assert running.notes == [
        "max_model_len lowered from the preset's 131072 to 8176 tokens, what the pool holds",
        "auth off: no TLS, no tokens (loopback only)",
    ]
    assert running.servicer.metadata.max_model_len == 8176
