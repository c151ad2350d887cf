"""Every hash algorithm, extra keys included, against vectors measured from vLLM 0.33.

The vectors (``tests/data/vectors/vllm_0_33_block_hashes.json``) were written by
``scripts/measure_vllm_hash_vectors.py`` run in a vLLM 0.33 venv: real ``Request`` objects (LoRA,
cache salt, multimodal features) hashed by vLLM's own block hasher, with ``NONE_HASH`` from the
case's seed. Here the same inputs go through kvservice's rule: digests, the int64 form, the event
``extra_keys`` the block pool publishes, and a vLLM-encoded batch carrying ``lookahead_token_ids``.
"""

from __future__ import annotations

import json

import pytest

from kvservice.core.block_pool import BlockPool
from kvservice.core.request import Request
from kvservice_client.events import BlockRemoved, BlockStored, decode_event_batch, encode_event_batch
from kvservice_client.hashing import (
    HASH_ALGORITHMS,
    BlockHasher,
    LoRA,
    MultiModalFeature,
    block_event_extra_keys,
    block_hash_to_int,
)
from tests.conftest import VECTORS_DIR

VECTORS = json.loads((VECTORS_DIR / "vllm_0_33_block_hashes.json").read_text())
CASES = VECTORS["cases"]


def _case_id(case: dict) -> str:
    parts = [case["algorithm"], f"seed={case['seed']}", f"{len(case['token_ids'])}tok"]
    if case.get("lora"):
        parts.append("lora")
    if case.get("cache_salt"):
        parts.append("salt")
    for f in case.get("mm_features", []):
        parts.append(f"mm@{f['offset']}+{f['length']}")
    return "-".join(parts)


def _inputs(case: dict) -> dict:
    lora = case.get("lora")
    return {
        "lora": LoRA(lora["lora_id"], lora["lora_name"], lora["lora_path"]) if lora else None,
        "cache_salt": case.get("cache_salt"),
        "mm_features": [
            MultiModalFeature(f["identifier"], f["offset"], f["length"]) for f in case.get("mm_features", [])
        ],
    }


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def test_vectors_cover_every_algorithm_and_extra_key():
    assert len(CASES) >= 20
    assert {c["algorithm"] for c in CASES} == set(HASH_ALGORITHMS) == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}
    for algorithm in HASH_ALGORITHMS:
        mine = [c for c in CASES if c["algorithm"] == algorithm]
        assert any(c.get("lora") for c in mine)
        assert any(c.get("cache_salt") for c in mine)
        assert sum(1 for c in mine if c.get("mm_features")) >= 4
        assert len({c["seed"] for c in mine}) >= 3


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_block_hashes_equal_vllm(case):
    hasher = BlockHasher(case["block_size"], case["algorithm"], case["seed"])
    assert hasher.root_hash.hex() == case["root_hash_hex"]
    hashes = hasher.hash_prompt(case["token_ids"], **_inputs(case))
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]
    assert [block_hash_to_int(h) for h in hashes] == case["block_hashes_int64"]


@pytest.mark.parametrize("case", [c for c in CASES if c["algorithm"] == "sha256_cbor"], ids=_case_id)
def test_hash_extra_keys_are_vllms(case):
    # The tagged tuples vLLM hashed, block by block, chained by hand, give the same digests.
    hasher = BlockHasher(case["block_size"], case["algorithm"], case["seed"])
    parent = None
    for i, keys in enumerate(case["hash_extra_keys"]):
        bs = case["block_size"]
        parent = hasher.hash_block(parent, case["token_ids"][i * bs : (i + 1) * bs], _tuples(keys))
        assert parent.hex() == case["block_hashes_hex"][i]


@pytest.mark.parametrize("case", [c for c in CASES if c["algorithm"] == "sha256_cbor"], ids=_case_id)
def test_event_extra_keys_are_vllms(case):
    inputs = _inputs(case)
    per_block = [block_event_extra_keys(i, case["block_size"], **inputs) for i in range(len(case["block_hashes_hex"]))]
    expected = case["event_extra_keys"]
    if expected is not None and all(k is None for k in expected):
        expected = None
    assert (per_block if any(k is not None for k in per_block) else None) == expected


def test_block_pool_publishes_vllms_extra_keys_and_hashes_for_an_image_prompt():
    case = next(c for c in CASES if c["algorithm"] == "xxhash_cbor" and len(c.get("mm_features", [])) == 2)
    hasher = BlockHasher(case["block_size"], "xxhash_cbor", case["seed"])
    inputs = _inputs(case)
    request = Request("r", case["token_ids"], block_hasher=hasher, **inputs)
    pool = BlockPool(num_blocks=8, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(len(request.block_hashes))
    pool.cache_full_blocks(request, blocks, request.block_hashes, 0, len(blocks), case["block_size"], 0)
    (stored,) = pool.take_events()
    assert stored.block_hashes == case["block_hashes_int64"]
    assert stored.extra_keys == case["event_extra_keys"]


def test_vllm_batch_with_lookahead_token_ids_decodes_and_reencodes_to_vllms_bytes():
    vector = VECTORS["lookahead_batch"]
    payload = bytes.fromhex(vector["payload_hex"])
    batch = decode_event_batch(payload)
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.lookahead_token_ids == vector["lookahead_token_ids"] == [[5, 6], [9, 10]]
    assert stored.block_hashes == [11, 12] and stored.medium == "GPU" and stored.group_idx == 0
    assert encode_event_batch(batch) == payload
