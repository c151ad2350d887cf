"""Drive vLLM's real scheduler over a trace with the model never run.

vLLM's own scheduler tests build a ``Scheduler`` on CPU and feed it a made-up
``ModelRunnerOutput`` each step; this module does the same over a whole trace, so the same run can
be made with vLLM's in-process KV cache manager and with the one on kvservice, and compared step by
step (``SchedulerOutput`` as :func:`step_record` reads it). Used by the equivalence tests,
``kvservice replay --scheduler vllm`` and ``scripts/bench/vllm_scheduler_bench.py``.

A trace item arrives at a step; each scheduled request that has computed its prompt gets its next
output token (the trace's own, so both runs see the same tokens), and stops after ``max_tokens``.
With ``AsyncScheduler`` the next step is scheduled before the previous one's output comes back, as
vLLM's async engine does.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DriveResult",
    "TraceDriver",
    "TraceItem",
    "make_scheduler",
    "model_runner_output",
    "run_trace",
    "step_record",
]

# A small Llama-shaped model config vLLM's ModelConfig reads from a local folder (no hub).
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class TraceItem:
    """One request: its prompt, its output tokens, and the step it arrives at.

    Attributes:
        request_id: unique in the trace.
        prompt_token_ids: the prompt, in tokens.
        output_token_ids: the tokens the fake model samples for it, in order (its max_tokens).
        arrival_step: the scheduler step it is added before (0 = before the first).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    arrival_step: int = 0


@dataclass
class DriveResult:
    """What a run did.

    Attributes:
        records: per step, :func:`step_record` of its ``SchedulerOutput``.
        step_seconds: per step, the wall time of ``schedule()`` and ``update_from_output()``.
        num_steps: steps run.
        num_round_trips: ManagerStep RPCs per step (0s for the in-process manager).
        num_preemptions: preemptions over the run.
        num_hit_tokens: prefix-cache hit tokens at admission over the run.
    """

    records: list[tuple[Any, ...]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    num_round_trips: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_hit_tokens: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.records)


def _model_dir() -> str:
    folder = Path(tempfile.gettempdir()) / "kvservice-vllm-model"
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    if not path.exists():
        path.write_text(json.dumps(_MODEL_CONFIG), encoding="utf-8")
    return str(folder)


def make_scheduler(
    *,
    num_blocks: int,
    block_size: int = 16,
    max_model_len: int = 32768,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    async_scheduling: bool = False,
    enable_prefix_caching: bool = True,
    num_layers: int = 32,
    num_kv_heads: int = 8,
    head_size: int = 128,
    scheduler_cls: type | None = None,
    kv_transfer_config: Any | None = None,
) -> Any:
    """A vLLM 0.33 scheduler on CPU for a Llama-shaped model of one full-attention group
    (``num_layers`` layers, ``num_kv_heads`` KV heads x ``head_size``, bf16; the model config says 8 x
    128, which only the KV cache spec's bytes would see), ``num_blocks`` blocks of ``block_size`` tokens,
    its KV cache manager vLLM's own (``install`` swaps it).

    Args:
        scheduler_cls: the class (default vLLM's ``Scheduler``, or ``AsyncScheduler`` with
            ``async_scheduling``).
        kv_transfer_config: vLLM's ``KVTransferConfig`` (a KV connector: the scheduler builds its
            scheduler side; :class:`TraceDriver`'s ``worker`` plays the worker side).
    """
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=_model_dir(), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16"
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(num_layers)], spec)],
    )
    cls = scheduler_cls or (AsyncScheduler if async_scheduling else Scheduler)
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def _make_request(item: TraceItem, block_hasher: Callable[..., Any]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=len(item.output_token_ids), ignore_eos=True)
    params.update_from_generation_config({}, None)
    return Request(
        request_id=item.request_id,
        prompt_token_ids=list(item.prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher,
    )


def step_record(output: Any) -> tuple[Any, ...]:
    """What a ``SchedulerOutput`` decided, as comparable values: new requests (id, block ids,
    computed tokens), cached requests (ids, resumed ids, new block ids, computed tokens), tokens
    scheduled per request, preempted and finished ids."""
    cached = output.scheduled_cached_reqs
    return (
        tuple((r.req_id, tuple(map(tuple, r.block_ids)), r.num_computed_tokens) for r in output.scheduled_new_reqs),
        tuple(cached.req_ids),
        tuple(sorted(cached.resumed_req_ids)),
        tuple(None if ids is None else tuple(map(tuple, ids)) for ids in cached.new_block_ids),
        tuple(cached.num_computed_tokens),
        tuple(sorted(output.num_scheduled_tokens.items())),
        tuple(sorted(output.preempted_req_ids or ())),
        tuple(sorted(output.finished_req_ids)),
    )


def model_runner_output(
    output: Any, sample: Callable[[str, int, int], list[int]], *, kv_connector_output: Any = None
) -> Any:
    """The ``ModelRunnerOutput`` a model that is never run answers for a step's ``SchedulerOutput``.

    Args:
        output: the step's ``SchedulerOutput``.
        sample: called once per scheduled request, in ``output.num_scheduled_tokens`` order, with
            (request id, its computed tokens before the step, after it), in tokens: the token ids
            it sampled (``[]`` while its prompt is not done).
        kv_connector_output: the worker side of a KV connector's ``KVConnectorOutput``, or None.

    Returns:
        vLLM's ``ModelRunnerOutput``: ``req_ids`` in that order, their sampled token ids, no
        logprobs or pooler output.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    before = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    req_ids = list(output.num_scheduled_tokens)
    sampled = [sample(r, before[r], before[r] + output.num_scheduled_tokens[r]) for r in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_connector_output,
    )


class TraceDriver:
    """vLLM's scheduler over a trace one step at a time (:func:`run_trace` runs one to the end;
    the tier replay steps two in lockstep, so one's stores reach the other between steps).

    Args:
        scheduler: a vLLM scheduler (``AsyncScheduler`` runs one step ahead, as vLLM's async engine).
        items: the trace, in any order (each arrives at its ``arrival_step``).
        on_step: called with (step index, ``SchedulerOutput``) after each ``schedule()``.
        worker: the worker side of a KV connector: called with each ``SchedulerOutput`` right after
            ``schedule()`` (before the step's forward pass would run); its ``KVConnectorOutput``
            (or None) goes back in that step's ``ModelRunnerOutput``.

    Attributes:
        result: the figures so far.
        num_steps: loop steps taken (empty ones included: the clock items arrive by).
    """

    def __init__(
        self,
        scheduler: Any,
        items: Iterable[TraceItem] = (),
        *,
        on_step: Callable[[int, Any], None] | None = None,
        worker: Callable[[Any], Any] | None = None,
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        init_none_hash(sha256)
        self.scheduler = scheduler
        self._hasher = get_request_block_hasher(scheduler.block_size, sha256)
        self._pending: deque[TraceItem] = deque(sorted(items, key=lambda it: it.arrival_step))
        self._outputs_of: dict[str, Sequence[int]] = {}
        self._num_sampled: dict[str, int] = {}
        self._in_flight: deque[tuple[Any, Any]] = deque()
        self._is_async = isinstance(scheduler, AsyncScheduler)
        self._on_step = on_step
        self._worker = worker
        self.result = DriveResult()
        self.num_steps = 0

    @property
    def busy(self) -> bool:
        """Items yet to arrive, requests (or connector work) in the scheduler, or a step in flight."""
        return bool(self._pending or self.scheduler.has_requests() or self._in_flight)

    def _sample(self, req_id: str, start: int, end: int) -> list[int]:
        """The trace's next output token for a request that computes the end of its prompt by
        ``end`` (in tokens), else none."""
        request = self.scheduler.requests.get(req_id)
        if request is None or end < request.num_prompt_tokens:
            return []
        tokens = self._outputs_of[req_id]
        k = self._num_sampled.get(req_id, 0)
        self._num_sampled[req_id] = k + 1
        return [tokens[min(k, len(tokens) - 1)]]

    def step(self) -> None:
        """One step: the items due arrive, ``schedule()`` (when anything is there), the worker, and
        ``update_from_output()`` of the step due back (the previous one under async scheduling)."""
        scheduler = self.scheduler
        result = self.result
        while self._pending and self._pending[0].arrival_step <= self.num_steps:
            item = self._pending.popleft()
            self._outputs_of[item.request_id] = item.output_token_ids
            scheduler.add_request(_make_request(item, self._hasher))
        manager = scheduler.kv_cache_manager
        trips = getattr(manager, "num_round_trips", 0)
        started = time.perf_counter()
        if self._pending or scheduler.has_requests():
            output = scheduler.schedule()
            result.records.append(step_record(output))
            result.num_preemptions += len(output.preempted_req_ids or ())
            result.num_hit_tokens += sum(r.num_computed_tokens for r in output.scheduled_new_reqs)
            if self._on_step is not None:
                self._on_step(self.num_steps, output)
            self._in_flight.append((output, None if self._worker is None else self._worker(output)))
        # Async scheduling keeps one step in flight: its output comes back after the next schedule().
        while self._in_flight and (
            not self._is_async or len(self._in_flight) > 1 or not (self._pending or scheduler.has_requests())
        ):
            done, kv_connector_output = self._in_flight.popleft()
            scheduler.update_from_output(
                done, model_runner_output(done, self._sample, kv_connector_output=kv_connector_output)
            )
        result.step_seconds.append(time.perf_counter() - started)
        result.num_round_trips.append(getattr(manager, "num_round_trips", 0) - trips)
        self.num_steps += 1


def run_trace(
    scheduler: Any,
    items: Iterable[TraceItem],
    *,
    max_steps: int = 1_000_000,
    on_step: Callable[[int, Any], None] | None = None,
    stop_at_max_steps: bool = False,
    worker: Callable[[Any], Any] | None = None,
) -> DriveResult:
    """Run ``scheduler`` until every item has finished (or ``max_steps``).

    Args:
        scheduler: a vLLM scheduler (``AsyncScheduler`` runs one step ahead, as vLLM's async engine).
        items: the trace, in arrival order.
        on_step: called with (step index, ``SchedulerOutput``) after each ``schedule()``.
        stop_at_max_steps: end after ``max_steps`` steps with requests left (a benchmark's window)
            instead of raising.
        worker: a KV connector's worker side (:class:`TraceDriver`).

    Returns:
        The run's records and figures.

    Raises:
        RuntimeError: ``max_steps`` steps ran and requests remain.
    """
    driver = TraceDriver(scheduler, items, on_step=on_step, worker=worker)
    while driver.busy:
        if driver.num_steps >= max_steps:
            if stop_at_max_steps:
                break
            raise RuntimeError(f"{max_steps} steps ran and {scheduler.get_num_unfinished_requests()} requests remain")
        driver.step()
    return driver.result


def mooncake_items(
    path: str | None = None, *, limit: int | None = None, step_ms: float = 25.0, max_prompt_tokens: int | None = None
) -> list[TraceItem]:
    """A Mooncake trace as :class:`TraceItem` s (the replay's token ids; the shipped sample by
    default), a request arriving at the first step after its timestamp (``step_ms`` per step).

    Args:
        path: the trace (default: the sample shipped with ``kvservice.replay``).
        limit: at most this many requests (after ``max_prompt_tokens``).
        step_ms: simulated milliseconds per scheduler step.
        max_prompt_tokens: leave out longer prompts (a pool smaller than the longest one).
    """
    from kvservice.replay.traces import DEFAULT_TRACE, output_token_ids, read_trace

    items = []
    for request in read_trace(path or DEFAULT_TRACE):
        if max_prompt_tokens is not None and request.num_prompt_tokens > max_prompt_tokens:
            continue
        items.append(
            TraceItem(
                request.request_id,
                request.prompt_token_ids.tolist(),
                output_token_ids(request.request_id, request.output_length).tolist(),
                int(request.arrival_ms // step_ms),
            )
        )
        if limit is not None and len(items) >= limit:
            break
    return items
