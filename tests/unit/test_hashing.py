"""The block-hash rule: vLLM's vectors, determinism, extra keys, incremental growth, resolution."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvservice_client.hashing as hashing_module
from kvservice_client.hashing import (
    DEFAULT_HASH_SEED,
    BlockHasher,
    LoRA,
    MultiModalFeature,
    block_hash_to_int,
    resolve_block_hashes,
)
from tests.conftest import VECTORS_DIR

VECTORS = json.loads((VECTORS_DIR / "vllm_sha256_cbor_block_hashes.json").read_text())


def test_root_hash_is_vllm_none_hash():
    hasher = BlockHasher(4)
    assert hasher.seed == DEFAULT_HASH_SEED == VECTORS["none_hash_seed"]
    assert hasher.root_hash.hex() == VECTORS["none_hash_hex"]


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["name"])
def test_vllm_sha256_cbor_vectors(case):
    hasher = BlockHasher(case["block_size"])
    lora = LoRA(1, case["lora"]["name"], case["lora"]["path"]) if case["lora"] else None
    hashes = hasher.hash_prompt(case["token_ids"], lora=lora, cache_salt=case["cache_salt"])
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]
    assert [block_hash_to_int(h) for h in hashes] == case["block_hashes_int64"]


def test_vector_extra_keys_match_rule():
    # The per-block extra keys the vectors list are the tagged tuples the rule hashes.
    case = next(c for c in VECTORS["cases"] if c["lora"])
    hasher = BlockHasher(4)
    lora = LoRA(7, "adapter-a", "/path/a")
    manual = []
    parent = None
    for i, keys in enumerate(case["extra_keys_per_block"]):
        parent = hasher.hash_block(parent, case["token_ids"][i * 4 : (i + 1) * 4], tuple(tuple(k) for k in keys))
        manual.append(parent)
    assert manual == hasher.hash_prompt(case["token_ids"], lora=lora)


def test_hash_changes_with_lora_salt_seed_and_algorithm_not_with_lora_id():
    tokens = list(range(1, 9))
    base = BlockHasher(4).hash_prompt(tokens)
    assert BlockHasher(4).hash_prompt(tokens, lora=LoRA(1, "a", "/p")) != base
    assert BlockHasher(4).hash_prompt(tokens, lora=LoRA(1, "a", "/p")) == BlockHasher(4).hash_prompt(
        tokens, lora=LoRA(2, "a", "/p")
    )
    salted = BlockHasher(4).hash_prompt(tokens, cache_salt="s")
    assert salted[0] != base[0] and salted[1] != base[1]  # block 1 differs through its parent
    assert BlockHasher(4, seed="other").hash_prompt(tokens) != base
    assert BlockHasher(4, "sha256").hash_prompt(tokens) != base
    xx = BlockHasher(4, "xxhash").hash_prompt(tokens)
    assert [len(h) for h in xx] == [16, 16]
    assert BlockHasher(4, "xxhash_cbor").hash_prompt(tokens) != xx


def test_multimodal_feature_enters_overlapping_blocks_only():
    tokens = list(range(12))
    plain = BlockHasher(4).hash_prompt(tokens)
    mm = BlockHasher(4).hash_prompt(tokens, mm_features=[MultiModalFeature("img0", offset=5, length=2)])
    assert mm[0] == plain[0]
    assert mm[1] != plain[1] and mm[2] != plain[2]


def test_unknown_algorithm_and_bad_block_size():
    with pytest.raises(
        ValueError, match="hash_algorithm must be one of sha256_cbor, sha256, xxhash, xxhash_cbor; got 'md5'"
    ):
        BlockHasher(4, "md5")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockHasher(0)


def test_incremental_extension_equals_one_shot():
    hasher = BlockHasher(4)
    tokens = list(range(1, 23))
    hashes: list[bytes] = []
    for n in range(0, len(tokens) + 1, 3):
        hasher.extend(hashes, tokens[:n])
    hasher.extend(hashes, tokens)
    assert hashes == hasher.hash_prompt(tokens)
    assert len(hashes) == 5


@pytest.mark.parametrize("algorithm", ["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"])
def test_hashes_equal_across_processes(algorithm):
    code = (
        "from kvservice_client.hashing import BlockHasher, LoRA;"
        f"print([h.hex() for h in BlockHasher(4, {algorithm!r}).hash_prompt(list(range(50)), "
        "lora=LoRA(1, 'x', '/x'), cache_salt='s')])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    here = [
        h.hex() for h in BlockHasher(4, algorithm).hash_prompt(list(range(50)), lora=LoRA(1, "x", "/x"), cache_salt="s")
    ]
    assert outs.pop().strip() == str(here)


def test_resolve_block_hashes_merges_multiples_and_rejects_other_ratios():
    hashes = BlockHasher(4).hash_prompt(list(range(20)))  # 5 blocks of 4
    assert resolve_block_hashes(hashes, 4, 4) is hashes
    merged = resolve_block_hashes(hashes, 4, 8)
    assert len(merged) == 2
    assert merged[0] == hashes[0] + hashes[1] and merged[1] == hashes[2] + hashes[3]
    assert merged[-1] == merged[1] and merged[0:2] == [merged[0], merged[1]]
    hashes.extend(BlockHasher(4).hash_prompt(list(range(24)))[5:])  # the view follows growth
    assert len(merged) == 3
    with pytest.raises(IndexError):
        merged[3]
    for bad in (6, 2):
        with pytest.raises(ValueError, match=f"block_size {bad} must be a multiple of the hash block size 4"):
            resolve_block_hashes(hashes, 4, bad)


@settings(max_examples=60, deadline=None)
@given(
    algorithm=st.sampled_from(["sha256_cbor", "xxhash_cbor"]),
    block_size=st.sampled_from([1, 4, 16, 23, 24, 300]),
    tokens=st.lists(
        st.one_of(
            st.integers(0, 30),
            st.integers(0, 300),
            st.integers(0, 70000),
            st.integers(0, 2**31 - 1),
            st.integers(-(2**40), 2**40),
        ),
        max_size=2000,
    ),
)
def test_vectorized_cbor_hashing_equals_cbor2(algorithm, block_size, tokens):
    # Prompts of >= _VECTORIZED_MIN_BLOCKS blocks take the one-pass numpy encoder; the rule is
    # canonical CBOR as cbor2 writes it, so both paths must give the same bytes and hashes.
    hasher = BlockHasher(block_size, algorithm)
    fast = hasher.hash_prompt(tokens)
    slow = []
    parent = None
    for i in range(len(tokens) // block_size):
        parent = hasher.hash_block(parent, tokens[i * block_size : (i + 1) * block_size], None)
        slow.append(parent)
    assert fast == slow
    in_range = [t for t in tokens if 0 <= t < 2**32]
    encoded, offsets = hashing_module._encode_token_ids_cbor(in_range)
    import cbor2

    assert encoded == b"".join(cbor2.dumps(t, canonical=True) for t in in_range)
    assert offsets.tolist()[-1] == len(encoded)


def test_hash_prompt_reads_bytes_as_the_server_reads_a_packed_prompt():
    import struct
    from array import array

    from kvservice_client.hashing import BlockHasher, unpack_token_ids

    hasher = BlockHasher(4)
    ids = [7, 300, 2**31 - 1, 0, 5, 6, 7, 8, 9]
    packed = struct.pack("<9i", *ids)
    assert hasher.hash_prompt(packed) == hasher.hash_prompt(ids) == hasher.hash_prompt(array("i", ids))
    assert hasher.hash_prompt(bytearray(packed)) == hasher.hash_prompt(memoryview(packed)) == hasher.hash_prompt(ids)
    assert list(unpack_token_ids(packed)) == ids
    with pytest.raises(ValueError, match="token ids: 7 bytes, not a multiple of 4"):
        hasher.hash_prompt(packed[:7])
