"""Shared workloads of the benchmarks: the request sequence the core and vLLM both run."""

from __future__ import annotations

import random


def prompts(num_requests: int, prompt_len: int, shared_fraction: float, seed: int = 0) -> list[list[int]]:
    """``num_requests`` prompts of ``prompt_len`` tokens; the first ``shared_fraction`` of each is one
    common prefix, the rest unique (ids below 100256, as a real tokenizer's)."""
    rng = random.Random(seed)
    num_shared = int(prompt_len * shared_fraction)
    shared = [rng.randrange(100256) for _ in range(num_shared)]
    return [shared + [rng.randrange(100256) for _ in range(prompt_len - num_shared)] for _ in range(num_requests)]
