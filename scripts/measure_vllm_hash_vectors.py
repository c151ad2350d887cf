"""Measure vLLM 0.33's block hashes and event extra keys from the outside and write them as JSON.

Run with the reference vLLM venv, from a folder that is not a vLLM source tree::

    cd "$(mktemp -d)" && /root/vllm-ref/bin/python /path/to/scripts/measure_vllm_hash_vectors.py \
        /path/to/tests/data/vectors/vllm_0_33_block_hashes.json

For every case it builds a real ``vllm.v1.request.Request`` (prompt, LoRA request, cache salt,
multimodal features), hashes it with vLLM's own ``get_request_block_hasher`` under one of vLLM's
algorithms, with ``NONE_HASH`` derived from the case's seed (vLLM reads the seed from
``PYTHONHASHSEED``; the script sets that variable in its own process before each case), and
records the digests (hex), vLLM's extra keys per block and the untagged per-block ``extra_keys``
vLLM's events publish. It also records one ``KVEventBatch`` encoded by vLLM's msgspec encoder
carrying ``lookahead_token_ids``. The project never imports vLLM: it only reads this file.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

BLOCK_SIZE = 4


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    return value


def _cases() -> list[dict[str, Any]]:
    prompt = list(range(1, 17))  # 4 full blocks of 4 tokens
    long_prompt = [7, 300, 70000, 5] * 5 + [2**31 + 3, 1]  # ids of every CBOR width, 5 blocks + 2
    cases: list[dict[str, Any]] = []
    for algorithm in ("xxhash", "xxhash_cbor", "sha256", "sha256_cbor"):
        for seed in ("vllm-none-hash", "0", "12345"):
            cases.append({"algorithm": algorithm, "seed": seed, "token_ids": prompt})
        cases.append({"algorithm": algorithm, "seed": "vllm-none-hash", "token_ids": long_prompt})
        cases.append(
            {
                "algorithm": algorithm,
                "seed": "vllm-none-hash",
                "token_ids": prompt,
                "lora": {"lora_id": 3, "lora_name": "sql-adapter", "lora_path": "/adapters/sql"},
            }
        )
        cases.append({"algorithm": algorithm, "seed": "vllm-none-hash", "token_ids": prompt, "cache_salt": "tenant-a"})
        # One image inside block 1 (offset 5 = 1 token into the block), spanning into block 2.
        cases.append(
            {
                "algorithm": algorithm,
                "seed": "vllm-none-hash",
                "token_ids": prompt,
                "mm_features": [{"identifier": "img-abc", "offset": 5, "length": 6}],
            }
        )
        # Same image, same tokens, one token later: vLLM's keys differ by the offset in the block.
        cases.append(
            {
                "algorithm": algorithm,
                "seed": "vllm-none-hash",
                "token_ids": prompt,
                "mm_features": [{"identifier": "img-abc", "offset": 6, "length": 6}],
            }
        )
        # Two items in one block, one starting at the block's first token.
        cases.append(
            {
                "algorithm": algorithm,
                "seed": "vllm-none-hash",
                "token_ids": prompt,
                "mm_features": [
                    {"identifier": "img-1", "offset": 4, "length": 2},
                    {"identifier": "img-2", "offset": 6, "length": 5},
                ],
            }
        )
        # LoRA + image + salt together (key order LoRA, mm, salt), image from token 0.
        cases.append(
            {
                "algorithm": algorithm,
                "seed": "vllm-none-hash",
                "token_ids": prompt,
                "lora": {"lora_id": 1, "lora_name": "a", "lora_path": "/a"},
                "cache_salt": "s",
                "mm_features": [{"identifier": "img-0", "offset": 0, "length": 9}],
            }
        )
    return cases


def _measure_case(case: dict[str, Any]) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    os.environ["PYTHONHASHSEED"] = case["seed"]
    hash_fn = get_hash_fn_by_name(case["algorithm"])
    kcu.init_none_hash(hash_fn)
    lora = case.get("lora")
    lora_request = LoRARequest(lora["lora_name"], lora["lora_id"], lora["lora_path"]) if lora is not None else None
    mm_features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=f["identifier"],
            mm_position=PlaceholderRange(offset=f["offset"], length=f["length"]),
        )
        for f in case.get("mm_features", [])
    ]
    request = Request(
        request_id="r",
        prompt_token_ids=list(case["token_ids"]),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=mm_features or None,
        lora_request=lora_request,
        cache_salt=case.get("cache_salt"),
        block_hasher=kcu.get_request_block_hasher(BLOCK_SIZE, hash_fn),
    )
    hashes = list(request.block_hashes)
    extra_keys = []
    mm_idx = 0
    for i in range(len(hashes)):
        keys, mm_idx = kcu.generate_block_hash_extra_keys(request, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE, mm_idx)
        extra_keys.append(keys)
    event_extra_keys = kcu.to_event_extra_keys(extra_keys)
    out = dict(case)
    out.update(
        block_size=BLOCK_SIZE,
        root_hash_hex=bytes(kcu.NONE_HASH).hex(),
        block_hashes_hex=[bytes(h).hex() for h in hashes],
        block_hashes_int64=[int.from_bytes(bytes(h)[-8:], "big") for h in hashes],
        hash_extra_keys=_jsonable(extra_keys),
        event_extra_keys=_jsonable(event_extra_keys),
    )
    return out


def _lookahead_batch() -> dict[str, Any]:
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    batch = KVEventBatch(
        ts=1700000000.5,
        events=[
            BlockStored(
                block_hashes=[11, 12],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                lookahead_token_ids=[[5, 6], [9, 10]],
            ),
            BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0),
        ],
        data_parallel_rank=None,
    )
    return {
        "description": "vLLM 0.33 KVEventBatch with lookahead_token_ids, encoded by vLLM's msgspec encoder",
        "lookahead_token_ids": [[5, 6], [9, 10]],
        "payload_hex": msgspec.msgpack.Encoder().encode(batch).hex(),
    }


def main() -> None:
    import vllm

    path = sys.argv[1]
    cases = [_measure_case(case) for case in _cases()]
    doc = {
        "source": f"vLLM {vllm.__version__}, measured by scripts/measure_vllm_hash_vectors.py",
        "rule": "hash[i] = H((parent or H(seed), tuple(block tokens), extra_keys)); "
        "xxhash = xxh3_128(pickle), xxhash_cbor = xxh3_128(canonical CBOR)",
        "cases": cases,
        "lookahead_batch": _lookahead_batch(),
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
