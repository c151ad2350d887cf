"""vLLM's ``KVCacheConfig`` as a kvservice layout file, and the check that a server holds it.

A kvservice server is laid out from a TOML layout file (``kvservice serve --kv-cache-layout``,
``kvservice.core.model_config.load_kv_cache_layout``). :func:`layout_toml` writes vLLM's groups
into one: a ``[[layers]]`` run per group with vLLM's layer names and ``group`` set, so the server
takes the groups as they are instead of grouping the layers again. :func:`check_server_layout`
compares a server's ``GetKVCacheGroupMetadata`` with the config and names the first field that
differs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UnsupportedKVCacheConfig", "check_server_layout", "group_kinds", "layout_toml"]


class UnsupportedKVCacheConfig(ValueError):
    """vLLM's KV cache config has something kvservice's manager does not hold (the message names
    the group and the field)."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _spec_kind(group_idx: int, spec: Any) -> tuple[str, dict[str, Any]]:
    """The layout kind and the fields of one vLLM spec (its class's meaning in kvservice)."""
    from vllm.v1 import kv_cache_interface as ki

    where = f"kv_cache_groups[{group_idx}] ({type(spec).__name__})"
    if isinstance(spec, ki.UniformTypeKVCacheSpecs):
        inner = {type(s) for s in spec.kv_cache_specs.values()}
        if len(inner) != 1 or len(set(spec.kv_cache_specs.values())) != 1:
            raise UnsupportedKVCacheConfig(f"{where}: layers of different specs in one group")
        spec = next(iter(spec.kv_cache_specs.values()))
    fields: dict[str, Any] = {}
    if getattr(spec, "page_size_padded", None) is not None:
        raise UnsupportedKVCacheConfig(f"{where}: page_size_padded={spec.page_size_padded} (padded pages)")
    names = {
        "SlidingWindowSpec": "sliding_window",
        "SlidingWindowMLASpec": "sliding_window_mla",
        "ChunkedLocalAttentionSpec": "chunked_local_attention",
        "CrossAttentionSpec": "cross_attention",
        "SinkFullAttentionSpec": "sink_full_attention",
        "MLAAttentionSpec": "mla_attention",
        "FullAttentionSpec": "full_attention",
    }
    kind = names.get(type(spec).__name__)
    if kind is None:
        raise UnsupportedKVCacheConfig(f"{where}: kvservice's manager holds no {type(spec).__name__} groups")
    if kind in ("full_attention", "mla_attention", "sink_full_attention"):
        for extra in ("sliding_window", "attention_chunk_size"):
            if getattr(spec, extra, None) is not None:
                raise UnsupportedKVCacheConfig(f"{where}: {extra}={getattr(spec, extra)} on a full-attention spec")
    if getattr(spec, "extra_retained_tokens", 0):
        raise UnsupportedKVCacheConfig(f"{where}: extra_retained_tokens={spec.extra_retained_tokens}")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise UnsupportedKVCacheConfig(f"{where}: head_size_v {spec.head_size_v} != head_size {spec.head_size}")
    fields["num_kv_heads"] = spec.num_kv_heads
    fields["head_size"] = spec.head_size
    fields["dtype"] = _dtype_name(spec.dtype)
    if kind in ("sliding_window", "sliding_window_mla"):
        fields["sliding_window"] = spec.sliding_window
    if kind == "chunked_local_attention":
        fields["attention_chunk_size"] = spec.attention_chunk_size
    if kind == "sink_full_attention":
        fields["sink_len"] = spec.sink_len
    return kind, fields


def group_kinds(kv_cache_config: Any) -> list[str]:
    """Each group's kvservice kind name (``full_attention``, ``sliding_window``, ...).

    Raises:
        UnsupportedKVCacheConfig: a group kvservice does not hold.
    """
    return [_spec_kind(i, g.kv_cache_spec)[0] for i, g in enumerate(kv_cache_config.kv_cache_groups)]


def layout_toml(kv_cache_config: Any, *, max_model_len: int, name: str = "vllm-kv-cache-config") -> str:
    """The layout file of vLLM's groups (``kvservice serve --kv-cache-layout FILE --num-blocks N``).

    Raises:
        UnsupportedKVCacheConfig: a group kvservice does not hold, or groups of different block
            sizes (one block size per layout file).
    """
    groups = kv_cache_config.kv_cache_groups
    block_sizes = {g.kv_cache_spec.block_size for g in groups}
    if len(block_sizes) != 1:
        raise UnsupportedKVCacheConfig(
            f"kv_cache_groups: block sizes {sorted(block_sizes)}; kvservice's layouts have one block size"
        )
    lines = [
        "# vLLM's KVCacheConfig as a kvservice layout (kvservice_vllm.layout.layout_toml): the groups as given.",
        f'name = "{name}"',
        f"max_model_len = {max_model_len}",
        f"block_size = {block_sizes.pop()}",
    ]
    used: set[str] = set()
    for g, group in enumerate(groups):
        kind, fields = _spec_kind(g, group.kv_cache_spec)
        names = []
        for layer in group.layer_names:
            unique = layer if layer not in used else f"{layer}@group{g}"
            used.add(unique)
            names.append(unique)
        lines.append("")
        lines.append("[[layers]]")
        lines.append(f'kind = "{kind}"')
        lines.append("names = [" + ", ".join(_quote(n) for n in names) + "]")
        lines.append(f"group = {g}")
        for key, value in fields.items():
            lines.append(f"{key} = {_quote(value) if isinstance(value, str) else value}")
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_server_layout(
    metadata: Any,
    kv_cache_config: Any,
    *,
    hash_block_size: int,
    enable_prefix_caching: bool,
    hash_algorithm: str,
    hash_seed: str,
) -> None:
    """Refuse a server whose pool is not vLLM's: the groups (count, kind, block size, window,
    chunk), ``num_blocks``, the hash block size and, with prefix caching, the hash rule.

    Args:
        metadata: the server's ``GetKVCacheGroupMetadataResponse``.
        kv_cache_config: vLLM's ``KVCacheConfig``.
        hash_block_size: vLLM's scheduler ``hash_block_size``.
        enable_prefix_caching, hash_algorithm, hash_seed: vLLM's cache config and none-hash seed.

    Raises:
        UnsupportedKVCacheConfig: a group kvservice does not hold.
        ValueError: the first field that differs, with both values.
    """
    from kvservice_client.convert import kv_cache_spec_kind_from_proto

    kinds = group_kinds(kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    if len(metadata.groups) != len(groups):
        raise ValueError(f"groups: the server has {len(metadata.groups)} KV cache groups, vLLM's config {len(groups)}")
    for g, (served, group, kind) in enumerate(zip(metadata.groups, groups, kinds)):
        spec = group.kv_cache_spec
        checks = [
            ("kind", kv_cache_spec_kind_from_proto(served.kind), kind),
            ("block_size", served.block_size, spec.block_size),
            ("num_blocks", served.num_blocks, kv_cache_config.num_blocks),
        ]
        if kind in ("sliding_window", "sliding_window_mla"):
            checks.append(("sliding_window", served.sliding_window, spec.sliding_window))
        if kind == "chunked_local_attention":
            checks.append(("attention_chunk_size", served.attention_chunk_size, spec.attention_chunk_size))
        for field, have, want in checks:
            if have != want:
                raise ValueError(f"groups[{g}].{field}: the server has {have!r}, vLLM's config {want!r}")
    if metadata.hash_block_size != hash_block_size:
        raise ValueError(
            f"hash_block_size: the server hashes blocks of {metadata.hash_block_size} tokens, vLLM of {hash_block_size}"
        )
    if enable_prefix_caching:
        if metadata.hash_algorithm != hash_algorithm:
            raise ValueError(
                f"hash_algorithm: the server has {metadata.hash_algorithm!r}, vLLM's prefix_caching_hash_algo "
                f"{hash_algorithm!r}"
            )
        if metadata.hash_seed != hash_seed:
            raise ValueError(
                f"hash_seed: the server's is {metadata.hash_seed!r}, vLLM's none-hash seed {hash_seed!r} "
                "(set PYTHONHASHSEED for vLLM, or --hash-seed for kvservice, so they agree)"
            )
