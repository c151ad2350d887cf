"""One Step (a scheduler step's worth of calls in one round trip): :class:`StepBuilder` composes
its ops, :func:`step_results` unpacks its answer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Union

from google.protobuf.message import Message

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.errors import KVServiceError
from kvservice_client.request_builders import (
    ReportMode,
    allocate_slots_request,
    decode_request,
    free_request,
    get_computed_blocks_request,
)

if TYPE_CHECKING:
    from kvservice_client.hashing import LoRA as HashingLoRA
    from kvservice_client.hashing import MultiModalFeature as HashingMultiModalFeature

__all__ = ["StepBuilder", "StepOpResponse", "decode_new_block_ids", "decode_result", "step_request", "step_results"]

StepOpResponse = Union[
    pb.GetComputedBlocksResponse,
    pb.AllocateSlotsResponse,
    pb.FreeResponse,
    pb.ResetPrefixCacheResponse,
    pb.GetUsageResponse,
    pb.DecodeResponse,
]
"""The response of one Step op that succeeded."""


def step_results(response: pb.StepResponse) -> list[StepOpResponse | KVServiceError]:
    """Unpack a Step's results: per op, in order, its response message or its error.

    A failed op is a :class:`KVServiceError` *value* in the list (not raised): a failed op fails
    only itself.

    Raises:
        ValueError: a result with nothing set.
    """
    results: list[StepOpResponse | KVServiceError] = []
    for idx, result in enumerate(response.results):
        which = result.WhichOneof("result")
        if which is None:
            raise ValueError(f"StepResponse.results[{idx}]: no result set")
        if which == "error":
            results.append(KVServiceError.from_op_status(result.error))
        else:
            results.append(getattr(result, which))
    return results


def decode_new_block_ids(response: pb.DecodeResponse) -> dict[int, tuple[list[int], ...]]:
    """Unpack a decode op's new blocks: request index -> per group (group_idx order) the block ids
    it appended. Requests not in the dict got no new block (or were refused or failed: see
    ``refused_indices`` and ``error_indices``).

    Raises:
        ValueError: the counts do not fit ``changed_indices``, ``num_groups`` or ``new_block_ids``.
    """
    num_groups = response.num_groups
    changed = list(response.changed_indices)
    counts = list(response.num_new_block_ids)
    ids = list(response.new_block_ids)
    if len(counts) != len(changed) * num_groups or sum(counts) != len(ids):
        raise ValueError(
            f"DecodeResponse: {len(counts)} counts summing to {sum(counts)} for {len(changed)} changed requests of "
            f"{num_groups} groups and {len(ids)} block ids"
        )
    out: dict[int, tuple[list[int], ...]] = {}
    pos = k = 0
    for index in changed:
        per_group = []
        for _ in range(num_groups):
            n = counts[k]
            per_group.append(ids[pos : pos + n])
            pos += n
            k += 1
        out[index] = tuple(per_group)
    return out


def decode_result(response: pb.StepResponse) -> pb.DecodeResponse:
    """The ``DecodeResponse`` of a Step of one decode op.

    Raises:
        KVServiceError: the op failed (its status).
    """
    result = response.results[0]
    if result.WhichOneof("result") == "error":
        raise KVServiceError.from_op_status(result.error)
    return result.decode


_STEP_OP_BY_REQUEST = {
    f.message_type.full_name: f.name for f in pb.StepOp.DESCRIPTOR.oneofs_by_name["op"].fields if f.message_type
}
"""The request message's full name -> the ``StepOp`` member that carries it."""


class StepBuilder:
    """Composes the ops of one Step (a scheduler step's worth of calls in one round trip).

    Methods take the same arguments as the client methods of the same name (without timeout and
    metadata) and return the builder, so calls chain. The server runs the ops in order, answers in
    order, and a failed op fails only itself (see :func:`step_results`).

    Example::

        ops = (
            StepBuilder()
            .get_computed_blocks("r1", prompt_token_ids)
            .allocate_slots("r1", num_new_tokens=len(prompt_token_ids))
            .free("r0")
        )
        results = step_results(client.step(ops))
    """

    __slots__ = ("_ops",)

    def __init__(self) -> None:
        self._ops: list[pb.StepOp] = []

    def __len__(self) -> int:
        """Number of ops so far."""
        return len(self._ops)

    def get_computed_blocks(
        self,
        request_id: str | pb.GetComputedBlocksRequest,
        prompt_token_ids: Iterable[int] = (),
        *,
        session_id: str | None = None,
        kv_cache_report_mode: ReportMode = None,
        lora: pb.LoRA | HashingLoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Iterable[pb.MultiModalFeature | HashingMultiModalFeature] = (),
    ) -> StepBuilder:
        """Add a GetComputedBlocks op (see :meth:`KVCacheClient.get_computed_blocks`)."""
        request = get_computed_blocks_request(
            request_id, prompt_token_ids, session_id, kv_cache_report_mode, lora, cache_salt, mm_features
        )
        self._ops.append(pb.StepOp(get_computed_blocks=request))
        return self

    def allocate_slots(
        self,
        request_id: str | pb.AllocateSlotsRequest,
        num_new_tokens: int | None = None,
        *,
        num_lookahead_tokens: int = 0,
        new_token_ids: Iterable[int] = (),
    ) -> StepBuilder:
        """Add an AllocateSlots op (see :meth:`KVCacheClient.allocate_slots`)."""
        request = allocate_slots_request(request_id, num_new_tokens, num_lookahead_tokens, new_token_ids)
        self._ops.append(pb.StepOp(allocate_slots=request))
        return self

    def free(self, request_id: str | pb.FreeRequest) -> StepBuilder:
        """Add a Free op (see :meth:`KVCacheClient.free`)."""
        self._ops.append(pb.StepOp(free=free_request(request_id)))
        return self

    def reset_prefix_cache(self) -> StepBuilder:
        """Add a ResetPrefixCache op."""
        self._ops.append(pb.StepOp(reset_prefix_cache=pb.ResetPrefixCacheRequest()))
        return self

    def get_usage(self) -> StepBuilder:
        """Add a GetUsage op."""
        self._ops.append(pb.StepOp(get_usage=pb.GetUsageRequest()))
        return self

    def decode(
        self,
        request_ids: Sequence[str] | pb.DecodeRequest,
        new_token_ids: Iterable[int] = (),
        *,
        num_new_token_ids: Iterable[int] = (),
        num_new_tokens: Iterable[int] = (),
        num_lookahead_tokens: Iterable[int] = (),
    ) -> StepBuilder:
        """Add a decode op: many running requests' appended tokens in packed arrays (see
        ``KVCacheClient.decode``); its result is a ``DecodeResponse``."""
        request = decode_request(request_ids, new_token_ids, num_new_token_ids, num_new_tokens, num_lookahead_tokens)
        self._ops.append(pb.StepOp(decode=request))
        return self

    def op(self, request: Message) -> StepBuilder:
        """Add the op whose ``StepOp`` member takes ``request``'s message type, as it is (any Step
        op, one without a method of its own here included).

        Raises:
            TypeError: no member of ``StepOp`` takes that type (naming the type and the members).
        """
        name = _STEP_OP_BY_REQUEST.get(request.DESCRIPTOR.full_name)
        if name is None:
            raise TypeError(
                f"no Step op takes a {request.DESCRIPTOR.full_name}; the ops take "
                f"{', '.join(sorted(_STEP_OP_BY_REQUEST))}"
            )
        op = pb.StepOp()
        getattr(op, name).CopyFrom(request)
        self._ops.append(op)
        return self

    def build(self) -> pb.StepRequest:
        """The ``StepRequest`` holding the ops added so far, in order (the builder stays usable)."""
        return pb.StepRequest(ops=self._ops)


def step_request(ops: pb.StepRequest | StepBuilder | Iterable[pb.StepOp]) -> pb.StepRequest:
    """The ``StepRequest`` of a client's ``step(ops)`` argument."""
    if isinstance(ops, pb.StepRequest):
        return ops
    if isinstance(ops, StepBuilder):
        return ops.build()
    return pb.StepRequest(ops=ops)
