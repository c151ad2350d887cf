"""KV cache specs, their kinds and KV cache groups.

A *KV cache spec* describes one attention layer's KV cache page: its block size (tokens per block)
and the bytes one block of that layer occupies (``page_size_bytes``). Layers are grouped into *KV
cache groups* as vLLM 0.33 groups them (``kv_cache_planning``: equal layer counts, one page size);
all groups of a model share one block pool (block ids are global) and one pool of memory (a block
id costs one group's page), and each group has its own single-type manager (see
``single_type_managers.py``). Per-layer specs come from a model's config, a layout file or a named
preset (``model_config``; ``ModelPreset``, ``PRESETS`` and ``get_preset`` are importable from here
too).

The class hierarchy mirrors vLLM's ``vllm/v1/kv_cache_interface.py``; dtypes are names (strings),
since the core does not import torch (``kvservice.memory`` maps them to torch dtypes).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "DTYPE_SIZE_BYTES",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    "dtype_size_bytes",
    "get_kv_cache_bytes_per_block",
    "get_kv_cache_spec_kind",
    "get_kv_cache_spec_sliding_window",
    "get_kv_cache_tensors",
    "get_per_layer_specs",
    "max_tokens_in_pool",
    "min_blocks_for_request",
]

DTYPE_SIZE_BYTES: Mapping[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Bytes per element of each KV dtype name (torch's names)."""


def dtype_size_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype``.

    Raises:
        ValueError: unknown dtype name (lists the known ones).
    """
    try:
        return DTYPE_SIZE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_SIZE_BYTES)}; got {dtype!r}") from None


class KVCacheSpecKind(str, enum.Enum):
    """The kind of a KV cache group, as published on events and in group metadata."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class KVCacheSpec:
    """Base spec: one layer's KV page.

    Attributes:
        block_size: tokens per block.
    """

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies."""
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer's K and V pages.

    Attributes:
        num_kv_heads: KV heads per layer.
        head_size: elements per head.
        dtype: element dtype name (see :data:`DTYPE_SIZE_BYTES`).
        page_size_padded: bytes one block of the layer occupies when its page is padded up to
            another layer's (vLLM 0.33's ``unify_kv_cache_spec_page_size``); None: unpadded.
    """

    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    page_size_padded: int | None = field(default=None, kw_only=True)

    @property
    def real_page_size_bytes(self) -> int:
        """``2 (K and V) * block_size * num_kv_heads * head_size * dtype bytes`` (no padding)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies: ``page_size_padded`` when set, else
        :attr:`real_page_size_bytes`."""
        return _padded(self.page_size_padded, self.real_page_size_bytes)


def _padded(page_size_padded: int | None, real_page_size_bytes: int) -> int:
    if page_size_padded is None:
        return real_page_size_bytes
    assert page_size_padded >= real_page_size_bytes, (
        f"page_size_padded {page_size_padded} is below the real page size {real_page_size_bytes}"
    )
    return page_size_padded


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: every token attends to every earlier token."""


@dataclass(frozen=True)
class OpaqueSpec(FullAttentionSpec):
    """A block of exactly ``opaque_bytes`` bytes of no model's shape: a shared tier's offload chunk
    (``--kv-cache-layout opaque:BYTES``; docs/tier.md). Its groups are full-attention groups (a
    key's hit is a prefix's); one layer, ``uint8``, one page of ``opaque_bytes`` per block."""

    opaque_bytes: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        """``opaque_bytes``."""
        return self.opaque_bytes


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek): one latent vector per token, no separate K and V.

    ``num_kv_heads`` is 1 and ``head_size`` is the latent width (kv_lora_rank + rope dim).
    """

    def __post_init__(self) -> None:
        _check_mla(self)

    @property
    def real_page_size_bytes(self) -> int:
        """``block_size * head_size * dtype bytes`` (one latent per token: no K/V factor 2)."""
        return _mla_page_size_bytes(self)


def _check_mla(spec: AttentionSpec) -> None:
    if spec.num_kv_heads != 1:
        raise ValueError(f"num_kv_heads must be 1 for MLA; got {spec.num_kv_heads}")


def _mla_page_size_bytes(spec: AttentionSpec) -> int:
    return spec.block_size * spec.num_kv_heads * spec.head_size * dtype_size_bytes(spec.dtype)


@dataclass(frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` learned sink tokens in front of the prompt (tokens)."""

    sink_len: int = 0


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token attends to the previous ``sliding_window`` tokens."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 token; got {self.sliding_window}")


@dataclass(frozen=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention over MLA latents (``num_kv_heads`` is 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_mla(self)

    @property
    def real_page_size_bytes(self) -> int:
        """As :class:`MLAAttentionSpec`."""
        return _mla_page_size_bytes(self)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (Llama 4): tokens attend within their ``attention_chunk_size``
    -token chunk only."""

    attention_chunk_size: int = 0

    def __post_init__(self) -> None:
        if self.attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1 token; got {self.attention_chunk_size}")


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder cross-attention over encoder outputs (encoder-decoder models)."""


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional encoder-only attention (no KV reuse across steps)."""


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A Mamba (state-space) layer's state: one block holds the whole recurrent state.

    Attributes:
        shapes: the state tensors' shapes (e.g. conv state, SSM state).
        dtypes: one dtype name per state tensor.
        page_size_padded: bytes one block occupies when padded up to the attention layers' page
            (vLLM 0.33 pads Mamba pages, which do not scale with block size); None: unpadded.
    """

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    page_size_padded: int | None = field(default=None, kw_only=True)

    @property
    def real_page_size_bytes(self) -> int:
        """Sum over state tensors of ``prod(shape) * dtype bytes`` (no padding)."""
        return sum(math.prod(s) * dtype_size_bytes(d) for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        """``page_size_padded`` when set, else :attr:`real_page_size_bytes`."""
        return _padded(self.page_size_padded, self.real_page_size_bytes)


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Several layers' specs of one attention type packed into one group (vLLM's wrapper).

    Attributes:
        kv_cache_specs: layer name -> that layer's spec; all share ``block_size``.
    """

    kv_cache_specs: Mapping[str, KVCacheSpec] = field(default_factory=dict)

    @property
    def page_size_bytes(self) -> int:
        """Sum of the inner specs' page sizes."""
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())


# Subclasses come before their bases, so the first match is the most specific kind.
_KIND_BY_CLASS: tuple[tuple[type[KVCacheSpec], KVCacheSpecKind], ...] = (
    (SlidingWindowMLASpec, KVCacheSpecKind.SLIDING_WINDOW_MLA),
    (SlidingWindowSpec, KVCacheSpecKind.SLIDING_WINDOW),
    (MLAAttentionSpec, KVCacheSpecKind.MLA_ATTENTION),
    (SinkFullAttentionSpec, KVCacheSpecKind.SINK_FULL_ATTENTION),
    (FullAttentionSpec, KVCacheSpecKind.FULL_ATTENTION),
    (ChunkedLocalAttentionSpec, KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION),
    (MambaSpec, KVCacheSpecKind.MAMBA),
    (EncoderOnlyAttentionSpec, KVCacheSpecKind.ENCODER_ONLY_ATTENTION),
    (CrossAttentionSpec, KVCacheSpecKind.CROSS_ATTENTION),
)


def get_kv_cache_spec_kind(spec: KVCacheSpec) -> KVCacheSpecKind:
    """The kind of ``spec``.

    Subclasses are checked before their bases (a ``SlidingWindowMLASpec`` is
    ``sliding_window_mla``, not ``sliding_window``). A :class:`UniformTypeKVCacheSpecs` is
    unwrapped: one inner kind gives that kind, mixed (or no) inner kinds give ``unknown``. Any
    other class gives ``unknown``.
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {get_kv_cache_spec_kind(inner) for inner in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else KVCacheSpecKind.UNKNOWN
    for cls, kind in _KIND_BY_CLASS:
        if isinstance(spec, cls):
            return kind
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(spec: KVCacheSpec) -> int | None:
    """The sliding window in tokens for windowed specs, else None.

    Windowed specs are :class:`SlidingWindowSpec` and its subclasses. A
    :class:`UniformTypeKVCacheSpecs` gives the window its inner specs share, or None when they
    differ (or none is windowed).
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        windows = {get_kv_cache_spec_sliding_window(inner) for inner in spec.kv_cache_specs.values()}
        return windows.pop() if len(windows) == 1 else None
    if isinstance(spec, SlidingWindowSpec):
        return spec.sliding_window
    return None


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """A KV cache group: layers sharing one spec, and therefore one block table per request.

    Attributes:
        layer_names: the group's layers (``num_layers = len(layer_names)``).
        kv_cache_spec: the spec every layer of the group has.
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    @property
    def num_layers(self) -> int:
        """Layers in the group."""
        return len(self.layer_names)

    @property
    def block_bytes(self) -> int:
        """Bytes one block id occupies in this group: ``page_size_bytes * num_layers``, or, for a
        :class:`UniformTypeKVCacheSpecs` (one inner spec per layer), its ``page_size_bytes``."""
        if isinstance(self.kv_cache_spec, UniformTypeKVCacheSpecs):
            return self.kv_cache_spec.page_size_bytes
        return self.kv_cache_spec.page_size_bytes * self.num_layers


@dataclass(frozen=True)
class KVCacheConfig:
    """What a block pool holds: ``num_blocks`` block ids shared by all groups, and one pool of
    ``num_blocks * block_bytes`` bytes all groups view (a block id is owned by one group at a time).

    Attributes:
        num_blocks: blocks in the pool, block 0 (the null block) included.
        kv_cache_groups: the groups, indexed by ``group_idx``.
    """

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block); got {self.num_blocks}")
        if not self.kv_cache_groups:
            raise ValueError("kv_cache_groups must hold at least one group")

    @property
    def block_bytes(self) -> int:
        """Bytes one block id costs in the pool all groups view: the largest group's
        :attr:`KVCacheGroupSpec.block_bytes` (vLLM 0.33; see :func:`get_kv_cache_bytes_per_block`)."""
        return get_kv_cache_bytes_per_block(self.kv_cache_groups)

    @property
    def kv_cache_tensors(self) -> tuple[KVCacheTensor, ...]:
        """The KV cache tensors placing every group's layers in the shared pool, in group order
        (see :func:`get_kv_cache_tensors`)."""
        return get_kv_cache_tensors(self.kv_cache_groups, self.num_blocks)

    @property
    def total_bytes(self) -> int:
        """Bytes of the pool: ``num_blocks * block_bytes``."""
        return self.num_blocks * self.block_bytes


def min_blocks_for_request(config: KVCacheConfig, num_tokens: int) -> int:
    """The fewest blocks, over all groups, a request of ``num_tokens`` tokens holds at once.

    Full attention (MLA, sink, cross, encoder-only) keeps every block; a sliding window keeps
    about its window (plus the block being written), chunked local attention its chunk, Mamba its
    latest state. A lower bound: a prefill chunk allocates a window group's blocks before older
    ones are released.
    """
    total = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        bs = spec.block_size
        all_blocks = -(-num_tokens // bs)
        kind = get_kv_cache_spec_kind(spec)
        if kind in (KVCacheSpecKind.SLIDING_WINDOW, KVCacheSpecKind.SLIDING_WINDOW_MLA):
            window = get_kv_cache_spec_sliding_window(spec) or num_tokens
            total += min(all_blocks, -(-(window - 1) // bs) + 2)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            total += min(all_blocks, -(-spec.attention_chunk_size // bs) + 1)
        elif kind is KVCacheSpecKind.MAMBA:
            total += min(all_blocks, 2)
        else:
            total += all_blocks
    return total


def max_tokens_in_pool(config: KVCacheConfig) -> int:
    """The longest request (tokens) whose :func:`min_blocks_for_request` fits the pool (null block
    excluded); 0 when not even one token fits."""
    usable = config.num_blocks - 1
    lo, hi = 0, 1
    while min_blocks_for_request(config, hi) <= usable and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if min_blocks_for_request(config, mid) <= usable:
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------------------------------
# Where a config's groups lie in the pool (the placement the planner and the memory share)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVCacheTensor:
    """One KV cache tensor: a run of same-spec layers of one group placed in the shared pool.

    Layer ``layer_names[l]``'s page for block ``b`` is the ``kv_cache_spec.real_page_size_bytes``
    bytes starting at ``offset + l * layer_stride + b * block_stride`` bytes into the pool
    allocation of ``size`` bytes (vLLM 0.33's ``KVCacheTensor``; earlier releases listed the
    layers as ``shared_by``). Tensors of different groups overlap: they alias the same bytes.

    Attributes:
        group_idx: the KV cache group whose layers these are.
        layer_names: the layers, in the L order of the strides.
        kv_cache_spec: the per-layer spec every one of them has.
        size: bytes of the backing allocation (the whole pool: ``num_blocks * bytes_per_block``).
        layer_stride: bytes between consecutive layers' pages of one block.
        block_stride: bytes between consecutive blocks' pages of one layer.
        offset: bytes from the start of the allocation to ``layer_names[0]``'s block 0.
    """

    group_idx: int
    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    size: int
    layer_stride: int
    block_stride: int
    offset: int

    @property
    def num_layers(self) -> int:
        """Layers sharing this tensor."""
        return len(self.layer_names)


def get_per_layer_specs(group: KVCacheGroupSpec) -> list[tuple[str, KVCacheSpec]]:
    """(layer name, that layer's spec) for every layer of ``group``, in order."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec.kv_cache_specs[name]) for name in group.layer_names]
    return [(name, spec) for name in group.layer_names]


def get_kv_cache_bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs in the shared pool: the largest group's sum of per-layer pages
    (vLLM 0.33's ``_get_kv_cache_bytes_per_block``; no backend here asks for a stride alignment).

    Raises:
        ValueError: no groups.
    """
    if not groups:
        raise ValueError("groups must hold at least one KV cache group")
    return max(sum(spec.page_size_bytes for _, spec in get_per_layer_specs(group)) for group in groups)


def _is_block_outermost(groups: Sequence[KVCacheGroupSpec]) -> bool:
    """Block-outermost packing only where layer-outermost cannot alias safely: several groups and
    pages of more than one size."""
    page_sizes = {spec.page_size_bytes for group in groups for _, spec in get_per_layer_specs(group)}
    return len(groups) > 1 and len(page_sizes) > 1


def get_kv_cache_tensors(groups: Sequence[KVCacheGroupSpec], num_blocks: int) -> tuple[KVCacheTensor, ...]:
    """The KV cache tensors of ``groups`` in a pool of ``num_blocks`` blocks, in group order and,
    within a group, by first layer (placement rules in the module docstring).

    Raises:
        ValueError: no groups, or ``num_blocks`` < 1.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
    bytes_per_block = get_kv_cache_bytes_per_block(groups)
    size = bytes_per_block * num_blocks
    block_outermost = _is_block_outermost(groups)
    tensors: list[KVCacheTensor] = []
    for group_idx, group in enumerate(groups):
        layers_by_spec: dict[KVCacheSpec, list[str]] = {}
        for name, spec in get_per_layer_specs(group):
            layers_by_spec.setdefault(spec, []).append(name)
        offset = 0
        for spec, names in layers_by_spec.items():
            page = spec.page_size_bytes
            if block_outermost:
                layer_stride, block_stride = page, bytes_per_block
                next_offset = offset + len(names) * page
            else:
                layer_stride, block_stride = page * num_blocks, page
                next_offset = offset + len(names) * layer_stride
            tensors.append(KVCacheTensor(group_idx, tuple(names), spec, size, layer_stride, block_stride, offset))
            offset = next_offset
        assert offset <= size, f"group {group_idx} needs {offset} bytes of a {size}-byte pool"
    return tuple(tensors)
