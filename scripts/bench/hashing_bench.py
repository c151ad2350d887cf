"""Hashing: block hashes per second for each algorithm, against hashlib/xxhash over the same bytes.

The baseline feeds the digest function the exact canonical-CBOR (or pickle) bytes each block
hashes, prepared beforehand, so the ratio is the cost of building those bytes and chaining.
"""

from __future__ import annotations

import hashlib
import pickle
import time

import cbor2
import xxhash

from kvservice_client.hashing import BlockHasher

try:
    from workloads import prompts
except ImportError:
    from scripts.bench.workloads import prompts


def _time(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(num_tokens: int = 262_144, block_size: int = 16) -> list[dict]:
    """One row per algorithm: hashes/s for kvservice and for the bare digest over the same bytes."""
    tokens = prompts(1, num_tokens, 0.0, seed=1)[0]
    num_blocks = num_tokens // block_size
    rows = []
    for algorithm, encode, digest in (
        ("sha256_cbor", lambda o: cbor2.dumps(o, canonical=True), lambda b: hashlib.sha256(b).digest()),
        ("sha256", lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL), lambda b: hashlib.sha256(b).digest()),
        ("xxhash", lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL), xxhash.xxh3_128_digest),
        ("xxhash_cbor", lambda o: cbor2.dumps(o, canonical=True), xxhash.xxh3_128_digest),
    ):
        hasher = BlockHasher(block_size, algorithm)
        hashes = hasher.hash_prompt(tokens)
        # The bytes each block hashes, built once, outside the baseline's timing.
        payloads = []
        parent = hasher.root_hash
        for i, h in enumerate(hashes):
            payloads.append(encode((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None)))
            parent = h
        ours = _time(lambda hasher=hasher: hasher.hash_prompt(tokens))
        floor = _time(lambda digest=digest, payloads=payloads: [digest(p) for p in payloads])
        rows.append(
            {"algorithm": algorithm, "hashes_per_s": num_blocks / ours, "floor_hashes_per_s": num_blocks / floor}
        )
    return rows


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
