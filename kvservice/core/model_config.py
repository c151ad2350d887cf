"""Per-layer KV cache specs from a model's Hugging Face ``config.json`` (as vLLM 0.33 derives them),
from an explicit layout file, or from a named preset (a built-in config).

Per architecture, each decoder layer gets the spec vLLM 0.33's model code gives it (TP 1):

- ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``: full
  attention, or a sliding window where ``layer_types`` says ``sliding_attention``; without
  ``layer_types`` every layer slides when the config has a ``sliding_window`` (vLLM's
  ``CacheConfig.sliding_window``: Mistral-7B-v0.1's 4096 tokens), except for Qwen2/Qwen3 with
  ``use_sliding_window`` false (their ``sliding_window`` is then unused, as in transformers).
- ``Gemma2ForCausalLM``: ``layer_types``, default every even layer sliding (``sliding_window``,
  default 4096).
- ``Gemma3ForCausalLM`` / ``Gemma3ForConditionalGeneration`` (``text_config``): ``layer_types``,
  default every ``sliding_window_pattern``-th layer (6) full and the rest sliding
  (``sliding_window``, default 4096).
- ``GptOssForCausalLM``: even layers slide (``sliding_window``, default 128), odd ones are full
  (vLLM's ``gpt_oss.py`` rule, whatever ``layer_types`` says).
- ``Llama4ForConditionalGeneration`` / ``Llama4ForCausalLM``: chunked local attention
  (``attention_chunk_size``, default 8192) on RoPE layers, full attention on NoPE layers
  (``no_rope_layers``; when empty, every ``nope_layer_interval``-th layer (4) is NoPE).
- ``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``: MLA, one latent of ``kv_lora_rank +
  qk_rope_head_dim`` elements per token.

Attention layers have ``num_key_value_heads`` KV heads (default ``num_attention_heads``) of
``head_dim`` elements (default ``hidden_size // num_attention_heads``; Gemma: 256). Required
(refused when missing or < 1, naming the field): ``num_hidden_layers``, ``num_attention_heads``,
``hidden_size`` when ``head_dim`` is absent, and for MLA ``kv_lora_rank`` and
``qk_rope_head_dim``. ``max_model_len`` is ``max_position_embeddings`` (architecture default when
missing); a window or chunk above it is refused.

dtype (``kv_cache_dtype``): ``auto`` takes the config's ``torch_dtype`` / ``dtype`` as vLLM resolves
it on CUDA (float32 becomes bfloat16; float16 stays, except for Gemma-2/3, which vLLM runs in
bfloat16; no dtype: bfloat16); or one of ``bfloat16``, ``float16``, ``fp8`` / ``fp8_e4m3``
(float8_e4m3fn), ``fp8_e5m2``. Block size: 16 tokens, vLLM 0.33's default on H100/H200 for all of
these (DeepSeek included), unless given.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvservice.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    dtype_size_bytes,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "KNOWN_ARCHITECTURES",
    "KV_CACHE_DTYPES",
    "ModelKVLayout",
    "ModelPreset",
    "PRESETS",
    "get_preset",
    "load_kv_cache_layout",
    "load_model_config",
    "model_kv_layout",
    "resolve_kv_cache_dtype",
]

DEFAULT_BLOCK_SIZE = 16
"""vLLM 0.33's block size on H100/H200 for every architecture here (``CacheConfig.DEFAULT_BLOCK_SIZE``)."""

KV_CACHE_DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
"""``--kv-cache-dtype`` values besides ``auto`` -> the dtype name the specs use."""

_LLAMA_LIKE = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 131072,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
}
_GEMMA2 = ("Gemma2ForCausalLM",)
_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_GPT_OSS = ("GptOssForCausalLM",)
_LLAMA4 = ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
KNOWN_ARCHITECTURES = (*_LLAMA_LIKE, *_GEMMA2, *_GEMMA3, *_GPT_OSS, *_LLAMA4, *_DEEPSEEK)
"""Architectures :func:`model_kv_layout` maps (``architectures[0]`` of a config.json)."""

_DEFAULT_MAX_POSITION_EMBEDDINGS = {
    **_LLAMA_LIKE,
    "Gemma2ForCausalLM": 8192,
    "Gemma3ForCausalLM": 131072,
    "Gemma3ForConditionalGeneration": 131072,
    "GptOssForCausalLM": 131072,
    "Llama4ForConditionalGeneration": 131072,
    "Llama4ForCausalLM": 131072,
    "DeepseekV2ForCausalLM": 2048,
    "DeepseekV3ForCausalLM": 4096,
}
_FLOAT16_NOT_SUPPORTED = _GEMMA2 + _GEMMA3


@dataclass(frozen=True)
class ModelKVLayout:
    """A model's KV cache layout, before grouping.

    Attributes:
        name: where it came from (preset name, config path or layout file path).
        architecture: the config's architecture (``"layout"`` for a layout file).
        layer_specs: layer name -> spec, in layer order.
        max_model_len: the longest request, in tokens.
        block_size: tokens per block of the specs.
    """

    name: str
    architecture: str
    layer_specs: Mapping[str, KVCacheSpec]
    max_model_len: int
    block_size: int
    layer_groups: Mapping[str, int] | None = None
    """Layer name -> its KV cache group, when the layout names the groups itself (a vLLM
    ``KVCacheConfig``'s, as given); None: vLLM 0.33's grouping decides."""

    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """The groups vLLM 0.33 forms from :attr:`layer_specs` (see ``kv_cache_planning``), or
        those :attr:`layer_groups` names (group ``g`` holds its layers in layer order, all of one
        spec).

        Raises:
            ValueError: named groups that are not 0..n-1, or a group of layers of different specs.
        """
        if self.layer_groups is None:
            from kvservice.core.kv_cache_planning import get_kv_cache_groups

            return get_kv_cache_groups(self.layer_specs)
        members: dict[int, list[str]] = {}
        for layer, group in self.layer_groups.items():
            members.setdefault(group, []).append(layer)
        if sorted(members) != list(range(len(members))):
            raise ValueError(f"{self.name}: the groups must be numbered 0..n-1; got {sorted(members)}")
        groups = []
        for g in range(len(members)):
            specs = {self.layer_specs[layer] for layer in members[g]}
            if len(specs) != 1:
                raise ValueError(f"{self.name}: group {g} holds layers of {len(specs)} different specs; one each")
            groups.append(KVCacheGroupSpec(tuple(members[g]), specs.pop()))
        return tuple(groups)


class _Fields:
    """Reads fields of one config mapping, naming them (with the file) in every error."""

    def __init__(self, source: str, mapping: Mapping[str, Any], where: str = "") -> None:
        self.source, self.mapping, self.where = source, mapping, where

    def _name(self, key: str) -> str:
        return f"{self.where}{key}"

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.mapping.get(key)
        return default if value is None else value

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.mapping.get(key)
        if value is None:
            if default is None:
                raise self.error(f"missing field {self._name(key)!r} (a positive integer)")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(f"{self._name(key)} must be an integer >= 1; got {value!r}")
        return value


def load_model_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face config, read from ``path`` (a ``config.json`` or the folder holding one; read
    locally, never fetched).

    Raises:
        ValueError: no such file, or not a JSON object (the message names the path).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"model_config {str(p)!r} cannot be read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"model_config {str(p)!r} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"model_config {str(p)!r} must hold a JSON object")
    return config


def resolve_kv_cache_dtype(kv_cache_dtype: str, config: Mapping[str, Any], architecture: str = "") -> str:
    """The KV dtype name for ``kv_cache_dtype`` (``auto`` resolved from ``config`` as vLLM does on
    CUDA: see the module docstring).

    Raises:
        ValueError: an unknown ``kv_cache_dtype`` (lists the known ones).
    """
    if kv_cache_dtype != "auto":
        try:
            return KV_CACHE_DTYPES[kv_cache_dtype]
        except KeyError:
            raise ValueError(
                f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}"
            ) from None
    text = config.get("text_config") or {}
    config_dtype = (
        config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "float32"
    )
    config_dtype = str(config_dtype).removeprefix("torch.")
    if config_dtype == "float16" and architecture not in _FLOAT16_NOT_SUPPORTED:
        return "float16"
    return "bfloat16"  # float32 (or none) downcast, bfloat16 kept, Gemma's float16 refused


def _layer_plan(arch: str, f: _Fields, num_layers: int) -> list[tuple[str, int | None]]:
    """(kind, window or chunk in tokens) per layer: kind is "full", "sliding", "chunked" or "mla"."""
    if arch in _DEEPSEEK:
        return [("mla", None)] * num_layers
    if arch in _GPT_OSS:
        gpt_oss_window = f.positive_int("sliding_window", 128)
        return [("sliding", gpt_oss_window) if i % 2 == 0 else ("full", None) for i in range(num_layers)]
    if arch in _LLAMA4:
        chunk = f.positive_int("attention_chunk_size", 8192)
        no_rope = f.get("no_rope_layers") or []
        if not no_rope:
            interval = f.positive_int("nope_layer_interval", 4)
            no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if len(no_rope) != num_layers:
            raise f.error(f"no_rope_layers has {len(no_rope)} entries; num_hidden_layers is {num_layers}")
        return [("chunked", chunk) if no_rope[i] else ("full", None) for i in range(num_layers)]
    layer_types = f.get("layer_types")
    if arch in _GEMMA2 and layer_types is None:
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if arch in _GEMMA3 and layer_types is None:
        pattern = f.positive_int("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    default_window = 4096 if arch in _GEMMA2 + _GEMMA3 else None
    window = f.get("sliding_window", default_window)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not f.get("use_sliding_window", False):
        window = None
        layer_types = None
    if layer_types is None:
        if window is None:
            return [("full", None)] * num_layers
        return [("sliding", f.positive_int("sliding_window"))] * num_layers
    if len(layer_types) != num_layers:
        raise f.error(f"layer_types has {len(layer_types)} entries; num_hidden_layers is {num_layers}")
    plan: list[tuple[str, int | None]] = []
    for i, layer_type in enumerate(layer_types):
        if layer_type == "sliding_attention":
            plan.append(("sliding", f.positive_int("sliding_window", default_window)))
        elif layer_type == "full_attention":
            plan.append(("full", None))
        else:
            raise f.error(f"layer_types[{i}] must be 'full_attention' or 'sliding_attention'; got {layer_type!r}")
    return plan


def model_kv_layout(
    config: Mapping[str, Any], *, name: str = "config", block_size: int | None = None, kv_cache_dtype: str = "auto"
) -> ModelKVLayout:
    """The per-layer KV specs of a Hugging Face config, as vLLM 0.33 derives them (module docstring).

    Args:
        config: the parsed ``config.json``.
        name: where it came from, for messages and metadata.
        block_size: tokens per block (default :data:`DEFAULT_BLOCK_SIZE`).
        kv_cache_dtype: ``auto`` or a :data:`KV_CACHE_DTYPES` key.

    Raises:
        ValueError: an unknown architecture (lists the known ones), a missing or bad field (named),
            a window or chunk above max_model_len, or a bad ``kv_cache_dtype`` / ``block_size``.
    """
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{name}: missing field 'architectures' (one of {', '.join(KNOWN_ARCHITECTURES)})")
    arch = architectures[0]
    if arch not in KNOWN_ARCHITECTURES:
        raise ValueError(f"{name}: unknown architecture {arch!r}; known: {', '.join(KNOWN_ARCHITECTURES)}")
    text = config.get("text_config")
    f = (
        _Fields(name, text, "text_config.")
        if isinstance(text, Mapping) and arch in _GEMMA3 + _LLAMA4
        else _Fields(name, config)
    )
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    if block_size < 1:
        raise ValueError(f"{name}: block_size must be >= 1 token; got {block_size}")
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, config, arch)
    num_layers = f.positive_int("num_hidden_layers")
    max_model_len = f.positive_int("max_position_embeddings", _DEFAULT_MAX_POSITION_EMBEDDINGS[arch])
    plan = _layer_plan(arch, f, num_layers)
    if arch in _DEEPSEEK:
        latent = f.positive_int("kv_lora_rank") + f.positive_int("qk_rope_head_dim")
        mla = MLAAttentionSpec(block_size, 1, latent, dtype)
        specs: dict[str, KVCacheSpec] = {f"model.layers.{i}.self_attn.attn": mla for i in range(num_layers)}
        return ModelKVLayout(name, arch, specs, max_model_len, block_size)
    num_heads = f.positive_int("num_attention_heads")
    num_kv_heads = f.positive_int("num_key_value_heads", num_heads)
    if f.get("head_dim") is not None:
        head_size = f.positive_int("head_dim")
    elif arch in _GEMMA2 + _GEMMA3:
        head_size = 256
    else:
        head_size = f.positive_int("hidden_size") // num_heads
        if head_size < 1:
            raise f.error(f"hidden_size // num_attention_heads must be >= 1; got {f.get('hidden_size')} // {num_heads}")
    prefix = (
        "language_model.model.layers"
        if arch in ("Gemma3ForConditionalGeneration", "Llama4ForConditionalGeneration")
        else "model.layers"
    )
    specs = {}
    for i, (kind, size) in enumerate(plan):
        layer = f"{prefix}.{i}.self_attn.attn"
        if size is not None and size > max_model_len:
            key = "attention_chunk_size" if kind == "chunked" else "sliding_window"
            raise f.error(f"{f._name(key)} of {size} tokens exceeds max_model_len ({max_model_len} tokens)")
        if kind == "sliding":
            specs[layer] = SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype, sliding_window=size or 0)
        elif kind == "chunked":
            specs[layer] = ChunkedLocalAttentionSpec(
                block_size, num_kv_heads, head_size, dtype, attention_chunk_size=size or 0
            )
        else:
            specs[layer] = FullAttentionSpec(block_size, num_kv_heads, head_size, dtype)
    return ModelKVLayout(name, arch, specs, max_model_len, block_size)


# --------------------------------------------------------------------------------------------------
# Layout files
# --------------------------------------------------------------------------------------------------

_LAYER_KINDS: dict[str, Callable[..., KVCacheSpec]] = {
    "full_attention": FullAttentionSpec,
    "sink_full_attention": SinkFullAttentionSpec,
    "sliding_window": SlidingWindowSpec,
    "chunked_local_attention": ChunkedLocalAttentionSpec,
    "cross_attention": CrossAttentionSpec,
    "mla_attention": MLAAttentionSpec,
    "sliding_window_mla": SlidingWindowMLASpec,
    "mamba": MambaSpec,
}
_KIND_KEYS = {
    "full_attention": set(),
    "sink_full_attention": {"sink_len"},
    "sliding_window": {"sliding_window"},
    "chunked_local_attention": {"attention_chunk_size"},
    "cross_attention": set(),
    "mla_attention": {"kv_lora_rank", "qk_rope_head_dim"},
    "sliding_window_mla": {"kv_lora_rank", "qk_rope_head_dim", "sliding_window"},
    "mamba": {"shapes", "dtypes"},
}
_COMMON_KEYS = {"kind", "count", "name", "names", "group", "dtype", "num_kv_heads", "head_size"}


def _layout_spec(f: _Fields, kind: str, block_size: int, dtype: str, max_model_len: int) -> KVCacheSpec:
    if kind == "mamba":
        shapes = f.get("shapes")
        dtypes = f.get("dtypes")
        if (
            not shapes
            or not isinstance(shapes, list)
            or not all(isinstance(s, list) and s and all(isinstance(d, int) and d >= 1 for d in s) for s in shapes)
        ):
            raise f.error(f"{f._name('shapes')} must be a list of state shapes of positive integers; got {shapes!r}")
        if not isinstance(dtypes, list) or len(dtypes) != len(shapes):
            raise f.error(f"{f._name('dtypes')} must give one dtype per state shape ({len(shapes)}); got {dtypes!r}")
        for d in dtypes:
            _check_dtype(f, "dtypes", d)
        return MambaSpec(block_size, shapes=tuple(tuple(s) for s in shapes), dtypes=tuple(dtypes))
    if kind in ("mla_attention", "sliding_window_mla"):
        if "head_size" in f.mapping:
            head_size = f.positive_int("head_size")
        else:
            head_size = f.positive_int("kv_lora_rank") + f.positive_int("qk_rope_head_dim")
        num_kv_heads = f.positive_int("num_kv_heads", 1)
        if num_kv_heads != 1:
            raise f.error(f"{f._name('num_kv_heads')} must be 1 for MLA (one latent per token); got {num_kv_heads}")
    else:
        num_kv_heads = f.positive_int("num_kv_heads")
        head_size = f.positive_int("head_size")
    extra: dict[str, int] = {}
    for key in ("sliding_window", "attention_chunk_size"):
        if key in _KIND_KEYS[kind]:
            extra[key] = f.positive_int(key)
            if extra[key] > max_model_len:
                raise f.error(f"{f._name(key)} of {extra[key]} tokens exceeds max_model_len ({max_model_len} tokens)")
    if kind == "sink_full_attention":
        extra["sink_len"] = f.positive_int("sink_len")
    return _LAYER_KINDS[kind](block_size, num_kv_heads, head_size, dtype, **extra)


def _check_dtype(f: _Fields, key: str, dtype: Any) -> str:
    try:
        dtype_size_bytes(dtype)
    except (ValueError, TypeError):
        raise f.error(f"{f._name(key)}: unknown dtype {dtype!r}") from None
    return cast(str, dtype)  # a key of DTYPE_SIZE_BYTES, whose keys are the dtype names


OPAQUE_PREFIX = "opaque:"
"""``--kv-cache-layout opaque:BYTES[xGROUPS]``: the opaque layout (docs/tier.md), not a file."""

OPAQUE_MAX_MODEL_LEN = 1 << 20
"""The opaque layout's max_model_len, in tokens (no model: a tier's puts are not bound by it)."""


def opaque_kv_layout(value: str, *, block_size: int | None = None) -> ModelKVLayout:
    """The opaque layout ``opaque:BYTES`` or ``opaque:BYTESxGROUPS``: every block exactly ``BYTES``
    bytes (a shared tier's offload chunk), ``GROUPS`` full-attention groups (default 1) of one
    ``uint8`` layer each (``opaque.{g}``), all viewing one pool, ``block_size`` tokens per block.

    Raises:
        ValueError: a value that is not ``opaque:`` and a positive byte count (and group count).
    """
    from kvservice.core.kv_cache_spec import OpaqueSpec

    spec_text = value[len(OPAQUE_PREFIX) :]
    bytes_text, times, groups_text = spec_text.partition("x")
    try:
        num_bytes = int(bytes_text)
        num_groups = int(groups_text) if times else 1  # "opaque:4096x" names no group count: refused
    except ValueError:
        num_bytes = num_groups = 0
    if num_bytes < 1 or num_groups < 1:
        raise ValueError(
            f"kv_cache_layout {value!r}: the opaque layout is opaque:BYTES or opaque:BYTESxGROUPS "
            "(bytes per block >= 1, groups >= 1)"
        )
    size = block_size or DEFAULT_BLOCK_SIZE
    spec = OpaqueSpec(block_size=size, num_kv_heads=1, head_size=1, dtype="uint8", opaque_bytes=num_bytes)
    names = [f"opaque.{g}" for g in range(num_groups)]
    return ModelKVLayout(
        value,
        "opaque",
        dict.fromkeys(names, spec),
        OPAQUE_MAX_MODEL_LEN,
        size,
        {name: g for g, name in enumerate(names)},
    )


def load_kv_cache_layout(
    path: str | Path, *, block_size: int | None = None, kv_cache_dtype: str = "auto"
) -> ModelKVLayout:
    """A layout file: per layer, or per run of layers, the kind and its parameters.

    TOML, e.g.::

        max_model_len = 32768        # required
        block_size = 16              # default 16 (block_size overrides)
        dtype = "bfloat16"           # default for every layer (kv_cache_dtype other than auto overrides)

        [[layers]]
        kind = "sliding_window"      # full_attention, sink_full_attention, sliding_window,
        count = 5                    # chunked_local_attention, cross_attention, mla_attention,
        num_kv_heads = 8             # sliding_window_mla, mamba; count: layers in the run (default 1)
        head_size = 128
        sliding_window = 1024

        [[layers]]
        kind = "mla_attention"       # head_size, or kv_lora_rank + qk_rope_head_dim
        kv_lora_rank = 512
        qk_rope_head_dim = 64

        [[layers]]
        kind = "mamba"
        shapes = [[3, 1024], [16, 64, 128]]
        dtypes = ["bfloat16", "float32"]

        [[layers]]                   # vLLM's own groups, as a KVCacheConfig has them:
        kind = "full_attention"      # every run gives `group` (0..n-1), and vLLM's grouping
        names = ["model.layers.0"]   # is skipped
        group = 0

    Layers are named ``layers.{i}`` unless a run gives ``name`` (then ``{name}.{j}``) or ``names``
    (its layers' names; ``count`` is their number). The same
    validation as for a config applies (missing or bad field, window or chunk above
    ``max_model_len``, unknown keys), and the same grouping.

    Raises:
        ValueError: unreadable or invalid TOML, or a bad entry (the message names the file, the
            run and the field).
    """
    p = Path(path)
    source = f"kv_cache_layout {str(p)!r}"
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{source} cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source} is not TOML: {exc}") from None
    top = _Fields(source, doc)
    unknown = set(doc) - {"max_model_len", "block_size", "dtype", "layers", "name"}
    if unknown:
        raise top.error(f"unknown keys {sorted(unknown)} (known: max_model_len, block_size, dtype, layers, name)")
    max_model_len = top.positive_int("max_model_len")
    if block_size is None:
        block_size = top.positive_int("block_size", DEFAULT_BLOCK_SIZE)
    default_dtype = _check_dtype(top, "dtype", top.get("dtype", "bfloat16"))
    if kv_cache_dtype != "auto":
        default_dtype = resolve_kv_cache_dtype(kv_cache_dtype, {})
    runs = doc.get("layers")
    if not runs or not isinstance(runs, list):
        raise top.error("missing field 'layers' (a [[layers]] array with at least one run)")
    specs: dict[str, KVCacheSpec] = {}
    layer_groups: dict[str, int] = {}
    grouped = [run.get("group") is not None for run in runs if isinstance(run, dict)]
    if any(grouped) and not all(grouped):
        raise top.error("'group' is given for some [[layers]] runs only: give it for every run or none")
    for run_idx, run in enumerate(runs):
        f = _Fields(source, run, f"layers[{run_idx}].")
        kind = run.get("kind")
        if kind not in _LAYER_KINDS:
            raise f.error(f"{f._name('kind')} must be one of {', '.join(_LAYER_KINDS)}; got {kind!r}")
        unknown = set(run) - _COMMON_KEYS - _KIND_KEYS[kind] - ({"head_size"} if kind == "mamba" else set())
        if kind == "mamba":
            unknown |= set(run) & {"num_kv_heads", "head_size"}
        if unknown:
            raise f.error(f"unknown keys {sorted(unknown)} for kind {kind!r}")
        names = run.get("names")
        if names is not None and (
            not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names)
        ):
            raise f.error(f"{f._name('names')} must be a non-empty list of layer names; got {names!r}")
        count = len(names) if names is not None else f.positive_int("count", 1)
        group = run.get("group")
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 0):
            raise f.error(f"{f._name('group')} must be an integer >= 0; got {group!r}")
        dtype = default_dtype if kv_cache_dtype != "auto" else _check_dtype(f, "dtype", f.get("dtype", default_dtype))
        spec = _layout_spec(f, kind, block_size, dtype, max_model_len)
        run_name = run.get("name")
        for j in range(count):
            if names is not None:
                layer = names[j]
            else:
                layer = f"{run_name}.{j}" if run_name else f"layers.{len(specs)}"
            if layer in specs:
                raise f.error(f"layer name {layer!r} is used twice")
            specs[layer] = spec
            if group is not None:
                layer_groups[layer] = group
    layout = ModelKVLayout(
        str(doc.get("name") or p.stem), "layout", specs, max_model_len, block_size, layer_groups or None
    )
    try:
        layout.kv_cache_groups()
    except ValueError as exc:
        raise top.error(str(exc).split(": ", 1)[-1]) from None
    return layout


# --------------------------------------------------------------------------------------------------
# Presets: named configs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    """A named model config (``--preset``), built like ``--model-config``.

    Attributes:
        name: the preset's name.
        description: the model it is.
        config: the Hugging Face config fields the layout needs (the real model's values).
    """

    name: str
    description: str
    config: Mapping[str, Any]
    default_block_size: int = DEFAULT_BLOCK_SIZE

    def kv_layout(self, block_size: int | None = None, kv_cache_dtype: str = "auto") -> ModelKVLayout:
        """The preset's per-layer specs at ``block_size`` tokens per block (default 16)."""
        return model_kv_layout(self.config, name=self.name, block_size=block_size, kv_cache_dtype=kv_cache_dtype)

    @property
    def max_model_len(self) -> int:
        """The longest request, in tokens (the config's ``max_position_embeddings``)."""
        return self.kv_layout().max_model_len

    def kv_cache_groups(self, block_size: int | None = None) -> tuple[KVCacheGroupSpec, ...]:
        """The preset's groups as vLLM 0.33 forms them, at ``block_size`` tokens per block."""
        return self.kv_layout(block_size).kv_cache_groups()

    def kv_cache_config(self, num_blocks: int, block_size: int | None = None) -> KVCacheConfig:
        """A :class:`KVCacheConfig` of ``num_blocks`` blocks for this preset."""
        return KVCacheConfig(num_blocks, self.kv_cache_groups(block_size))


PRESETS: Mapping[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "llama-3-8b",
            "Llama-3.1-8B: 32 full-attention layers, 8 KV heads x 128, bf16, 128k context",
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "max_position_embeddings": 131072,
                "torch_dtype": "bfloat16",
            },
        ),
        ModelPreset(
            "qwen-2.5-0.5b",
            "Qwen2.5-0.5B: 24 full-attention layers, 2 KV heads x 64, bf16, 32k context",
            {
                "architectures": ["Qwen2ForCausalLM"],
                "hidden_size": 896,
                "num_attention_heads": 14,
                "num_hidden_layers": 24,
                "num_key_value_heads": 2,
                "max_position_embeddings": 32768,
                "max_window_layers": 21,
                "sliding_window": 32768,
                "use_sliding_window": False,
                "torch_dtype": "bfloat16",
            },
        ),
        ModelPreset(
            "gemma-3-27b",
            "Gemma-3-27B: 52 sliding-window (1024 tokens) + 10 full-attention layers (5:1), 16 KV heads x 128, "
            "bf16, 128k context; vLLM's 7 groups (6 sliding window of 9, 9, 9, 9, 8, 8 layers, 1 full of 10)",
            {
                "architectures": ["Gemma3ForConditionalGeneration"],
                "torch_dtype": "bfloat16",
                "text_config": {
                    "head_dim": 128,
                    "hidden_size": 5376,
                    "num_attention_heads": 32,
                    "num_hidden_layers": 62,
                    "num_key_value_heads": 16,
                    "sliding_window": 1024,
                },
            },
        ),
        ModelPreset(
            "llama-4-scout",
            "Llama-4-Scout: 36 chunked-local (8192 tokens) + 12 full-attention layers (3:1), 8 KV heads x 128, "
            "bf16, 10M context; vLLM's 4 groups of 12",
            {
                "architectures": ["Llama4ForConditionalGeneration"],
                "torch_dtype": "bfloat16",
                "text_config": {
                    "attention_chunk_size": 8192,
                    "head_dim": 128,
                    "hidden_size": 5120,
                    "max_position_embeddings": 10485760,
                    "no_rope_layers": [],
                    "num_attention_heads": 40,
                    "num_hidden_layers": 48,
                    "num_key_value_heads": 8,
                },
            },
        ),
        ModelPreset(
            "deepseek-v3",
            "DeepSeek-V3: 61 MLA layers, latent 512 + rope 64, bf16, 160k context, block size 16",
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "hidden_size": 7168,
                "kv_lora_rank": 512,
                "max_position_embeddings": 163840,
                "num_attention_heads": 128,
                "num_hidden_layers": 61,
                "num_key_value_heads": 128,
                "qk_rope_head_dim": 64,
                "torch_dtype": "bfloat16",
            },
        ),
    )
}
"""Named presets: real models' configs (``--preset``)."""


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {name!r}") from None
