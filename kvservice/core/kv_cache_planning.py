"""KV cache planning as vLLM 0.33's hybrid allocator does it: per-layer specs -> KV cache groups,
one pool of memory all groups view, and ``num_blocks`` for a byte budget.

The rules mirror ``vllm/v1/core/kv_cache_planning.py`` (``get_kv_cache_groups``,
``unify_kv_cache_spec_page_size``, ``_get_kv_cache_groups_uniform_page_size``,
``_get_kv_cache_bytes_per_block``, ``get_kv_cache_config_from_groups``) with the KV cache layout
vLLM 0.33 resolves on H100/H200 for these models: ``LBNHC`` (layer outermost; no attention
backend there declares a layout, so the default preference's first entry wins):

1. **Grouping** (:func:`get_kv_cache_groups`).

   - All layers have one spec (or mergeable ones: full attention layers differing only in being
     sink attention): one group of every layer.
   - Else all layers are of one *type* (same block size; all full attention, MLA included; or all
     sliding window with one window; all chunked local with one chunk; all Mamba with one page
     size; all cross attention): one group whose spec is a
     :class:`~kvservice.core.kv_cache_spec.UniformTypeKVCacheSpecs` of the per-layer specs.
   - Else (a hybrid model) the page sizes are unified first: a layer whose page divides the
     largest page gets ``block_size * ratio``; another non-MLA attention layer, or a Mamba layer,
     gets its page padded (``page_size_padded``) to the largest; anything else is refused. Then
     layers are bucketed by spec (in layer order), the smallest bucket's layer count is the group
     size (the largest's, when it is below 1.5x the smallest), and each bucket of ``n`` layers
     becomes ``ceil(n / group_size)`` groups, group ``i`` taking ``layers[i::num_groups]``
     (so the last groups of a bucket may be one layer short: padding).

   Gemma-3-27B (52 sliding-window + 10 full attention layers, equal pages): group size 10, the
   sliding window bucket (first in layer order) becomes 6 groups of 9, 9, 9, 9, 8, 8 layers and
   the full attention bucket one group of 10.

2. **Sharing** (:func:`get_kv_cache_tensors`). All groups view one allocation of
   ``num_blocks * bytes_per_block`` bytes from byte 0, so one block id costs one group's page, not
   the sum of all groups' pages: a block id is owned by one group at a time, and a group's view of
   block ``b`` never overlaps another group's view of block ``b' != b``. Per group, one
   :class:`KVCacheTensor` per distinct layer spec (in first-layer order) places its layers:
   layer ``l``'s page for block ``b`` starts at ``offset + l * layer_stride + b * block_stride``.

   - Every page in the model the same size (always after unification): layer outermost,
     ``block_stride = page``, ``layer_stride = num_blocks * page`` (vLLM's ``LBNHC``).
   - Pages of different sizes in several groups (only from hand-built groups; vLLM's
     layer-outermost layout refuses them, its block-outermost ones pack them): block outermost,
     ``block_stride = bytes_per_block``, ``layer_stride = page``, each group's layers packed
     side by side inside every block (vLLM's ``BLNHC``).

3. **Sizing** (:func:`get_kv_cache_bytes_per_block`, :func:`get_num_blocks`): one block id costs
   the largest group's sum of per-layer pages (``bytes_per_block``), and
   ``num_blocks = budget_bytes // bytes_per_block``, block 0 (the null block) included, as
   vLLM's ``get_kv_cache_configs`` computes it.

Pure Python (no torch): ``kvservice.memory`` turns the :class:`KVCacheTensor` list into tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from kvservice.core.kv_cache_spec import (  # the placement lives with KVCacheConfig; re-exported here
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_bytes_per_block,
    get_kv_cache_tensors,
    get_per_layer_specs,
)

logger = logging.getLogger(__name__)

__all__ = [
    "KVCacheTensor",
    "get_kv_cache_bytes_per_block",
    "get_kv_cache_config",
    "get_kv_cache_groups",
    "get_kv_cache_tensors",
    "get_num_blocks",
    "get_per_layer_specs",
    "unify_kv_cache_spec_page_size",
]


# --------------------------------------------------------------------------------------------------
# Spec compatibility (vLLM's ``merge`` and ``is_uniform_with_collection`` rules)
# --------------------------------------------------------------------------------------------------


def _attention_fields(spec: AttentionSpec) -> tuple[object, ...]:
    return (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, spec.page_size_padded)


def _can_merge(specs: Sequence[KVCacheSpec]) -> bool:
    """Whether vLLM's ``type(specs[0]).merge(specs)`` accepts ``specs``: equal specs, or full
    attention (non-MLA, sink included) layers with equal attention fields."""
    first = specs[0]
    if all(spec == first for spec in specs[1:]):
        return True
    if isinstance(first, FullAttentionSpec) and not isinstance(first, MLAAttentionSpec):
        return all(
            isinstance(spec, FullAttentionSpec)
            and not isinstance(spec, MLAAttentionSpec)
            and _attention_fields(spec) == _attention_fields(first)
            for spec in specs
        )
    return False


def _is_uniform_type(specs: Sequence[KVCacheSpec]) -> bool:
    """vLLM's ``UniformTypeKVCacheSpecs.is_uniform_type``: one block size and layers that always
    need the same number of token slots."""
    if len({spec.block_size for spec in specs}) > 1:
        return False
    first = specs[0]
    if isinstance(first, SlidingWindowSpec):  # SlidingWindowMLASpec too, as in vLLM
        return all(isinstance(s, SlidingWindowSpec) and s.sliding_window == first.sliding_window for s in specs)
    if isinstance(first, ChunkedLocalAttentionSpec):
        return all(
            isinstance(s, ChunkedLocalAttentionSpec) and s.attention_chunk_size == first.attention_chunk_size
            for s in specs
        )
    if isinstance(first, MambaSpec):
        return all(isinstance(s, MambaSpec) and s.page_size_bytes == first.page_size_bytes for s in specs)
    for base in (FullAttentionSpec, CrossAttentionSpec, EncoderOnlyAttentionSpec):
        if isinstance(first, base):
            return all(isinstance(s, base) for s in specs)
    return all(type(s) is type(first) for s in specs)


# --------------------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------------------


def unify_kv_cache_spec_page_size(layer_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Give every layer the largest layer's page size (vLLM 0.33's rule).

    A layer whose page divides the largest page gets ``block_size * ratio`` (same bytes per token,
    more tokens per block); otherwise a non-MLA attention layer or a Mamba layer gets
    ``page_size_padded`` set to the largest page.

    Args:
        layer_specs: layer name -> spec.

    Returns:
        layer name -> spec, every ``page_size_bytes`` equal (the input when it already is).

    Raises:
        ValueError: a layer's page neither divides the largest nor can be padded (an MLA layer);
            the message names the layer and both page sizes.
    """
    page_sizes = {spec.page_size_bytes for spec in layer_specs.values()}
    if len(page_sizes) <= 1:
        return dict(layer_specs)
    max_page = max(page_sizes)
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in layer_specs.items():
        page = spec.page_size_bytes
        if page == max_page:
            new_spec = spec
        elif isinstance(spec, MambaSpec):
            new_spec = replace(spec, page_size_padded=max_page)
        elif max_page % page == 0:
            new_spec = replace(spec, block_size=spec.block_size * (max_page // page))
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            new_spec = replace(spec, page_size_padded=max_page)
        else:
            raise ValueError(
                f"layer {name}: page size {page} bytes does not divide the largest page ({max_page} bytes) "
                "and an MLA page cannot be padded"
            )
        assert new_spec.page_size_bytes == max_page, (name, new_spec.page_size_bytes, max_page)
        unified[name] = new_spec
    return unified


def _merged_spec(specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
    assert _can_merge(specs), f"layers of one KV cache group must share one spec; got {set(specs)}"
    return specs[0]


def get_kv_cache_groups(layer_specs: Mapping[str, KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """The KV cache groups vLLM 0.33 forms from per-layer specs (rules in the module docstring).

    Args:
        layer_specs: layer name -> that layer's spec, in layer order (the order decides which
            bucket's groups come first and which layers each group gets).

    Returns:
        The groups, indexed by ``group_idx``; every layer is in exactly one group.

    Raises:
        ValueError: no layers, or page sizes that cannot be unified (see
            :func:`unify_kv_cache_spec_page_size`).
    """
    if not layer_specs:
        raise ValueError("layer_specs must hold at least one layer (an attention-free model has no KV cache)")
    names = list(layer_specs)
    specs = list(layer_specs.values())
    if _can_merge(specs):
        return (KVCacheGroupSpec(tuple(names), _merged_spec(specs)),)
    if _is_uniform_type(specs):
        uniform = UniformTypeKVCacheSpecs(block_size=specs[0].block_size, kv_cache_specs=dict(layer_specs))
        return (KVCacheGroupSpec(tuple(names), uniform),)

    unified = unify_kv_cache_spec_page_size(layer_specs)
    same_spec_layers: dict[KVCacheSpec, list[str]] = {}
    for name, spec in unified.items():
        same_spec_layers.setdefault(spec, []).append(name)
    # Buckets of mergeable specs, in first-layer order.
    layer_buckets: list[list[str]] = []
    spec_buckets: list[list[KVCacheSpec]] = []
    for spec, spec_names in same_spec_layers.items():
        for bucket_names, bucket_specs in zip(layer_buckets, spec_buckets):
            if _can_merge([*bucket_specs, spec]):
                bucket_names.extend(spec_names)
                bucket_specs.append(spec)
                break
        else:
            layer_buckets.append(list(spec_names))
            spec_buckets.append([spec])

    min_num_layers = min(len(bucket) for bucket in layer_buckets)
    max_num_layers = max(len(bucket) for bucket in layer_buckets)
    # vLLM's heuristic: the "1" of an n:1 pattern is the group size, unless the buckets are close
    # in size (e.g. 12 + 13 layers), where padding the smaller one wastes less.
    group_size = max_num_layers if max_num_layers < min_num_layers * 1.5 else min_num_layers
    groups: list[KVCacheGroupSpec] = []
    for bucket in layer_buckets:
        num_groups = -(-len(bucket) // group_size)
        num_padding_layers = num_groups * group_size - len(bucket)
        if num_padding_layers:
            logger.info(
                "KV cache grouping pads %d layers (%.2f %% of %d) to groups of %d",
                num_padding_layers,
                100 * num_padding_layers / len(bucket),
                len(bucket),
                group_size,
            )
        for i in range(num_groups):
            group_names = bucket[i::num_groups]
            groups.append(KVCacheGroupSpec(tuple(group_names), _merged_spec([unified[n] for n in group_names])))
    return tuple(groups)


# --------------------------------------------------------------------------------------------------
# Sharing and sizing
# --------------------------------------------------------------------------------------------------


def get_num_blocks(groups: Sequence[KVCacheGroupSpec], budget_bytes: int) -> int:
    """Blocks a budget of ``budget_bytes`` holds: ``budget_bytes // bytes_per_block`` (vLLM 0.33's
    ``get_kv_cache_configs``), block 0 (the null block) included.

    Raises:
        ValueError: no groups, the groups occupy 0 bytes per block, or fewer than 2 blocks (the
            null block and one usable block) fit; the message names the budget, the bytes per block
            and the minimum budget.
    """
    bytes_per_block = get_kv_cache_bytes_per_block(groups)
    if bytes_per_block <= 0:
        raise ValueError("the KV cache groups occupy 0 bytes per block; a budget cannot size them")
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"memory budget of {budget_bytes} bytes holds {max(num_blocks, 0)} blocks of "
            f"{bytes_per_block} bytes each (the largest KV cache group's pages); at least 2 blocks "
            f"({2 * bytes_per_block} bytes) are needed, block 0 being the null block"
        )
    return num_blocks


def get_kv_cache_config(
    layer_specs: Mapping[str, KVCacheSpec], *, budget_bytes: int | None = None, num_blocks: int | None = None
) -> KVCacheConfig:
    """Group ``layer_specs`` and size the pool from a byte budget or a block count.

    Args:
        layer_specs: layer name -> spec, in layer order.
        budget_bytes: bytes the KV cache may occupy (exactly one of this and ``num_blocks``).
        num_blocks: blocks in the pool, null block included.

    Raises:
        ValueError: both or neither sizes given, or as :func:`get_kv_cache_groups` and
            :func:`get_num_blocks`.
    """
    if (budget_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of budget_bytes and num_blocks")
    groups = get_kv_cache_groups(layer_specs)
    if num_blocks is None:
        assert budget_bytes is not None
        num_blocks = get_num_blocks(groups, budget_bytes)
    return KVCacheConfig(num_blocks, groups)
