"""Shared workloads of the benchmarks: the request sequences the core and vLLM both run.

Nothing here imports kvservice or vLLM: ``core_ops.py`` and ``vllm_core_ops.py`` (which runs in
vLLM's own venv) build the same prompts from these functions.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MOONCAKE_SAMPLE = Path(__file__).resolve().parents[2] / "kvservice/replay/data/mooncake_conversation_sample.jsonl"
"""The Mooncake conversation trace sample shipped with the replay (Apache-2.0)."""

MOONCAKE_BLOCK_TOKENS = 512


def prompts(num_requests: int, prompt_len: int, shared_fraction: float, seed: int = 0) -> list[list[int]]:
    """``num_requests`` prompts of ``prompt_len`` tokens; the first ``shared_fraction`` of each is one
    common prefix, the rest unique (ids below 100256, as a real tokenizer's)."""
    rng = random.Random(seed)
    num_shared = int(prompt_len * shared_fraction)
    shared = [rng.randrange(100256) for _ in range(num_shared)]
    return [shared + [rng.randrange(100256) for _ in range(prompt_len - num_shared)] for _ in range(num_requests)]


def mooncake_prompts(limit: int) -> list[list[int]]:
    """The first ``limit`` prompts of the Mooncake sample, in arrival order: each trace block id
    becomes 512 token ids (the same ids wherever it recurs, so shared prefixes and returning
    conversation turns hit as in the trace), cut to the request's ``input_length``."""
    blocks: dict[int, list[int]] = {}
    out = []
    with MOONCAKE_SAMPLE.open() as f:
        for line in f:
            if len(out) >= limit:
                break
            if not line.strip():
                continue
            obj = json.loads(line)
            tokens: list[int] = []
            for h in obj["hash_ids"]:
                if h not in blocks:
                    rng = random.Random(h * 7919 + 1)
                    blocks[h] = [rng.randrange(100256) for _ in range(MOONCAKE_BLOCK_TOKENS)]
                tokens += blocks[h]
            out.append(tokens[: obj["input_length"]])
    return out


def sequence(workload: str, num_requests: int, prompt_len: int, shared_fraction: float) -> list[list[int]]:
    """The prompts of a named workload: ``synthetic`` (:func:`prompts`) or ``mooncake``."""
    if workload == "mooncake":
        return mooncake_prompts(num_requests)
    return prompts(num_requests, prompt_len, shared_fraction)
