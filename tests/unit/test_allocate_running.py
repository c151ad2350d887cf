"""KVCacheEngine.allocate_running (ManagerStep's AllocateSlotsBatch): the same as update_request
(appending) then allocate_owned of each request, in order; refused whole when any request's
fields are bad; ended by the first refusal."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvservice.core.engine import KVCacheEngine
from kvservice.core.errors import InvalidArgumentError, RequestNotFoundError
from tests.unit.core_helpers import free_ids, make_manager

BS = 4


def _hashes(tokens: list[int], seed: bytes = b"root") -> list[bytes]:
    out, parent = [], seed
    for i in range(len(tokens) // BS):
        parent = hashlib.sha256(parent + bytes(str(tokens[i * BS : (i + 1) * BS]), "ascii")).digest()
        out.append(parent)
    return out


def _engine(num_blocks: int = 24) -> KVCacheEngine:
    return KVCacheEngine(make_manager(num_blocks))


def _running(engine: KVCacheEngine, request_id: str, prompt: list[int]) -> None:
    engine.update_request(
        request_id,
        num_tokens_kept=0,
        token_ids=prompt,
        num_block_hashes_kept=0,
        block_hashes=_hashes(prompt),
        num_prompt_tokens=len(prompt),
    )
    assert engine.allocate_owned(request_id, num_computed_tokens=0, num_new_tokens=len(prompt)).allocated


def _state(engine: KVCacheEngine):
    manager = engine.manager
    return (
        {rid: engine.manager.get_block_ids(rid) for rid in engine.requests},
        {rid: (r.num_tokens, len(r.block_hashes)) for rid, r in engine.requests.items()},
        free_ids(manager),
        [type(e).__name__ for e in manager.block_pool.kv_event_queue],
    )


PROMPTS = {"a": list(range(7)), "b": list(range(100, 112)), "c": list(range(200, 203))}


def test_a_batch_equals_the_calls_one_by_one():
    one, many = _engine(), _engine()
    for engine in (one, many):
        for rid, prompt in PROMPTS.items():
            _running(engine, rid, prompt)
    steps = [("a", 7, [9]), ("b", 12, [8]), ("c", 3, [7])]  # each decodes one token
    for rid, computed, new in steps:
        full = PROMPTS[rid] + new
        hashes = _hashes(full)[len(_hashes(PROMPTS[rid])) :]
        one.update_request(
            rid,
            num_tokens_kept=len(PROMPTS[rid]),
            token_ids=new,
            num_block_hashes_kept=len(_hashes(PROMPTS[rid])),
            block_hashes=hashes,
        )
        one.allocate_owned(rid, num_computed_tokens=computed, num_new_tokens=1)
    result = many.allocate_running(
        ["a", "b", "c"],
        num_computed_tokens=[7, 12, 3],
        num_new_tokens=[1, 1, 1],
        num_new_token_ids=[1, 1, 1],
        token_ids=np.array([9, 8, 7], dtype="<i4"),
        num_new_block_hashes=[1, 0, 1],
        block_hashes=_hashes(PROMPTS["a"] + [9])[1:] + _hashes(PROMPTS["c"] + [7]),
    )
    assert (result.num_run, result.refused) == (3, False)
    # a (7 -> 8 tokens) fits its 2 blocks; b (12 -> 13) and c (3 -> 4) need one more each... c's
    # 4th token fills its first block; b's 13th starts a fourth block.
    assert result.changed_indices == [1]
    assert result.new_block_ids == [(one.manager.get_block_ids("b")[0][3:],)]
    assert _state(one) == _state(many)
    one.check_invariants()
    many.check_invariants()


def test_the_first_refusal_ends_the_batch_and_the_ones_before_stay_allocated():
    engine = _engine(num_blocks=9)  # 8 usable blocks
    _running(engine, "a", list(range(12)))  # 3 blocks
    _running(engine, "b", list(range(100, 116)))  # 4 blocks: 1 free left
    result = engine.allocate_running(["a", "b"], num_computed_tokens=[12, 16], num_new_tokens=[4, 8])
    assert (result.num_run, result.refused) == (2, True)  # a took the last block, b found none
    assert result.changed_indices == [0]
    assert len(engine.manager.get_block_ids("a")[0]) == 4
    assert len(engine.manager.get_block_ids("b")[0]) == 4
    assert engine.requests["b"].num_computed_tokens == 0  # the refused one keeps its last call's counts


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        (dict(request_ids=["a", "a"]), "request_ids", "a request is named twice"),
        (dict(request_ids=["a", "nope"]), None, "'nope' is not registered"),
        (dict(num_new_tokens=[1]), "num_new_tokens", "1 entries for 2 request_ids"),
        (dict(num_new_tokens=[1, 0]), "num_new_tokens", "0 outside 1..4096"),
        (dict(num_in_flight_tokens=[8, 0]), "num_in_flight_tokens", "8 above num_computed_tokens 7"),
        (dict(num_new_token_ids=[1, 0]), "packed_token_ids", "0 ids, but num_new_token_ids adds up to 1"),
        (dict(num_new_token_ids=[1, 0], token_ids=np.array([-3], dtype="<i4")), "packed_token_ids", "token id -3"),
        (dict(num_new_block_hashes=[1, 0], block_hashes=[b"x" * 32]), "block_hashes", "more hashes than full blocks"),
        (dict(num_new_block_hashes=[1, 0], block_hashes=[b"x" * 31]), "block_hashes", "a hash of 31 bytes"),
    ],
)
def test_a_bad_field_refuses_the_whole_batch_changing_nothing(kwargs, field, message):
    engine = _engine()
    _running(engine, "a", PROMPTS["a"])
    _running(engine, "b", PROMPTS["b"])
    engine.update_request(
        "w", num_tokens_kept=0, token_ids=[1, 2], num_block_hashes_kept=0, block_hashes=[], num_prompt_tokens=2
    )
    args = dict(request_ids=["a", "b"], num_computed_tokens=[7, 12], num_new_tokens=[1, 1])
    args.update(kwargs)
    if args["request_ids"] == ["a", "a"]:
        args["num_computed_tokens"] = [7, 7]
    before = _state(engine)
    with pytest.raises((InvalidArgumentError, RequestNotFoundError), match=message) as err:
        engine.allocate_running(args.pop("request_ids"), **args)
    if field is not None:
        assert err.value.field == field
    assert _state(engine) == before


def test_a_waiting_request_is_refused_in_a_batch():
    engine = _engine()
    _running(engine, "a", PROMPTS["a"])
    engine.update_request(
        "w", num_tokens_kept=0, token_ids=[1, 2], num_block_hashes_kept=0, block_hashes=[], num_prompt_tokens=2
    )
    before = _state(engine)
    with pytest.raises(InvalidArgumentError, match="'w' holds no blocks"):
        engine.allocate_running(["a", "w"], num_computed_tokens=[7, 0], num_new_tokens=[1, 2])
    assert _state(engine) == before
