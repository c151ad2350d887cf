"""KV cache tensors: layouts, bytes per block, block views, sizing and allocation failures.

Everything runs on CPU with tiny configs, or on the ``meta`` device for real presets (a real
llama-3-8b block is 2 MiB); the one CUDA test is marked and skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvservice import memory
from kvservice.core.kv_cache_planning import get_kv_cache_config
from kvservice.core.kv_cache_spec import (
    DTYPE_SIZE_BYTES,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
)
from kvservice.core.model_config import get_preset
from kvservice.memory import (
    KVCacheAllocationError,
    KVCacheTensors,
    allocate_kv_cache_tensors,
    cuda_memory_budget,
    num_blocks_from_budget,
    resolve_device,
    torch_dtype,
)

META = torch.device("meta")
CPU = torch.device("cpu")


def make_group(spec: KVCacheSpec, num_layers: int, prefix: str = "layer") -> KVCacheGroupSpec:
    return KVCacheGroupSpec(tuple(f"{prefix}{i}" for i in range(num_layers)), spec)


def make_config(*groups: KVCacheGroupSpec, num_blocks: int = 5) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, tuple(groups))


def tiny_attention_config(num_blocks: int = 5) -> KVCacheConfig:
    """3 layers x [2 (K, V), 4 tokens, 2 heads, 8 elements] float32: 1536 bytes per block."""
    spec = FullAttentionSpec(4, num_kv_heads=2, head_size=8, dtype="float32")
    return make_config(make_group(spec, 3), num_blocks=num_blocks)


MAMBA_SPEC = MambaSpec(16, shapes=((3, 64), (8, 16, 4)), dtypes=("bfloat16", "float32"))


# ------------------------------------------------------------------------------------------------
# Presets: exact shapes, dtypes and bytes per block
# ------------------------------------------------------------------------------------------------

PRESET_LAYOUTS = {
    # preset -> per group: (view shapes with N for num_blocks, the group's bytes per block)
    "llama-3-8b": [([(32, "N", 16, 8, 256)], 2_097_152)],
    "deepseek-v3": [([(61, "N", 16, 576)], 1_124_352)],
}


def _fill(shape: tuple[object, ...], num_blocks: int) -> tuple[int, ...]:
    return tuple(num_blocks if d == "N" else d for d in shape)  # type: ignore[misc]


@pytest.mark.parametrize("preset_name", sorted(PRESET_LAYOUTS))
def test_preset_shapes_dtype_and_bytes_per_block_on_meta(preset_name: str) -> None:
    num_blocks = 7
    config = get_preset(preset_name).kv_cache_config(num_blocks, block_size=16)
    kv = allocate_kv_cache_tensors(config, META)

    assert kv.device == META
    assert kv.num_groups == len(PRESET_LAYOUTS[preset_name])
    for group_idx, (shapes, block_bytes) in enumerate(PRESET_LAYOUTS[preset_name]):
        tensors = kv.tensors(group_idx)
        assert [tuple(t.shape) for t in tensors] == [_fill(s, num_blocks) for s in shapes]
        assert kv.dtype(group_idx) == torch.bfloat16
        assert kv.bytes_per_block(group_idx) == block_bytes == config.kv_cache_groups[group_idx].block_bytes
    assert kv.bytes_per_block() == config.block_bytes
    assert kv.total_bytes == num_blocks * config.block_bytes


def test_hybrid_preset_groups_share_one_pool_of_the_largest_groups_pages() -> None:
    config = get_preset("gemma-3-27b").kv_cache_config(7, block_size=16)
    kv = allocate_kv_cache_tensors(config, META)
    page = 2 * 16 * 16 * 128 * 2  # K and V, 16 tokens, 16 KV heads x 128, bf16
    largest = max(group.num_layers for group in config.kv_cache_groups)
    assert kv.bytes_per_block() == config.block_bytes == largest * page
    assert kv.total_bytes == 7 * largest * page
    [raw] = kv.raw_tensors
    assert (raw.dtype, raw.numel(), raw.device) == (torch.uint8, 7 * largest * page, META)


@pytest.mark.parametrize("preset_name", ["llama-3-8b", "gemma-3-27b", "deepseek-v3"])
def test_preset_allocates_one_zeroed_cpu_pool_at_small_block_size(preset_name: str) -> None:
    config = get_preset(preset_name).kv_cache_config(num_blocks=2, block_size=1)
    kv = allocate_kv_cache_tensors(config, "cpu")

    [raw] = kv.raw_tensors
    assert raw.device == CPU and raw.numel() == kv.total_bytes == 2 * config.block_bytes and not raw.any()
    for group_idx, group in enumerate(config.kv_cache_groups):
        assert kv.bytes_per_block(group_idx) == group.block_bytes
        for t in kv.tensors(group_idx):
            assert t.device == CPU and t.dtype == torch.bfloat16
            assert t.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


def test_mamba_spec_views_its_page_as_bytes() -> None:
    config = make_config(make_group(MAMBA_SPEC, 4), num_blocks=3)
    kv = allocate_kv_cache_tensors(config, CPU)

    assert [tuple(t.shape) for t in kv.tensors(0)] == [(4, 3, 3 * 64 * 2 + 8 * 16 * 4 * 4)]
    assert kv.dtypes(0) == (torch.uint8,)
    assert kv.bytes_per_block(0) == 4 * (3 * 64 * 2 + 8 * 16 * 4 * 4) == 9728 == config.kv_cache_groups[0].block_bytes
    assert kv.block_dims(0) == (1,)


@pytest.mark.parametrize(
    "spec",
    [
        FullAttentionSpec(4, 2, 8, "float16"),
        SinkFullAttentionSpec(4, 2, 8, "float16", sink_len=4),
        SlidingWindowSpec(4, 2, 8, "float16", sliding_window=8),
        ChunkedLocalAttentionSpec(4, 2, 8, "float16", attention_chunk_size=16),
        CrossAttentionSpec(4, 2, 8, "float16"),
        EncoderOnlyAttentionSpec(4, 2, 8, "float16"),
    ],
    ids=lambda spec: type(spec).__name__,
)
def test_every_attention_kind_gets_the_kv_layout(spec: KVCacheSpec) -> None:
    config = make_config(make_group(spec, 3), num_blocks=5)
    kv = allocate_kv_cache_tensors(config, CPU)

    # [L, N, B tokens, H heads, K|V]: vLLM 0.33's LBNHC page.
    assert [tuple(t.shape) for t in kv.tensors(0)] == [(3, 5, 4, 2, 16)]
    assert kv.dtype(0) == torch.float16
    assert kv.bytes_per_block(0) == 3 * 2 * 4 * 2 * 8 * 2 == config.kv_cache_groups[0].block_bytes
    assert kv.block_dims(0) == (1,)
    [t] = kv.kv_cache_tensors
    assert (t.layer_stride, t.block_stride, t.offset, t.size) == (5 * 256, 256, 0, 5 * 3 * 256)


@pytest.mark.parametrize(
    "spec",
    [MLAAttentionSpec(4, 1, 24, "float8_e4m3fn"), SlidingWindowMLASpec(4, 1, 24, "float8_e4m3fn", sliding_window=8)],
    ids=lambda spec: type(spec).__name__,
)
def test_mla_kinds_hold_one_latent_per_token(spec: KVCacheSpec) -> None:
    config = make_config(make_group(spec, 2), num_blocks=4)
    kv = allocate_kv_cache_tensors(config, CPU)

    assert [tuple(t.shape) for t in kv.tensors(0)] == [(2, 4, 4, 24)]
    assert kv.dtype(0) == torch.float8_e4m3fn
    assert kv.bytes_per_block(0) == 2 * 4 * 24 == config.kv_cache_groups[0].block_bytes


def test_mla_with_several_kv_heads_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_kv_heads must be 1 for MLA; got 2"):
        MLAAttentionSpec(4, 2, 24)


def test_uniform_type_specs_get_one_tensor_per_distinct_layer_spec() -> None:
    inner = {
        "a": FullAttentionSpec(4, 2, 8, "float16"),  # 2 * 4 * 2 * 8 * 2 = 256 bytes per block
        "b": FullAttentionSpec(4, 1, 8, "float16"),  # 128 bytes per block
        "c": FullAttentionSpec(4, 2, 8, "float16"),
    }
    spec = UniformTypeKVCacheSpecs(4, kv_cache_specs=inner)
    config = make_config(KVCacheGroupSpec(("a", "b", "c"), spec), num_blocks=3)
    kv = allocate_kv_cache_tensors(config, CPU)

    assert [tuple(t.shape) for t in kv.tensors(0)] == [(2, 3, 4, 2, 16), (1, 3, 4, 1, 16)]
    assert kv.bytes_per_block(0) == spec.page_size_bytes == 640 == config.block_bytes
    assert [(t.layer_names, t.layer_stride, t.block_stride, t.offset) for t in kv.kv_cache_tensors] == [
        (("a", "c"), 3 * 256, 256, 0),
        (("b",), 3 * 128, 128, 2 * 3 * 256),
    ]


def test_hybrid_config_costs_the_largest_groups_bytes_per_block() -> None:
    config = make_config(
        make_group(FullAttentionSpec(4, 2, 8, "float32"), 2, "full"),
        make_group(SlidingWindowSpec(4, 2, 8, "float32", sliding_window=8), 3, "swa"),
        make_group(MAMBA_SPEC, 1, "mamba"),
        num_blocks=4,
    )
    kv = allocate_kv_cache_tensors(config, CPU)

    assert [kv.bytes_per_block(g) for g in range(3)] == [1024, 1536, 2432]
    assert kv.bytes_per_block() == 2432 == config.block_bytes
    assert kv.total_bytes == 4 * 2432
    # Pages of several sizes in several groups: block outermost, each block id one 2432-byte slot.
    assert {(t.block_stride, t.offset) for t in kv.kv_cache_tensors} == {(2432, 0)}


# ------------------------------------------------------------------------------------------------
# Block views: one pool, no two live views overlap
# ------------------------------------------------------------------------------------------------


def small_hybrid_config(num_blocks: int = 6) -> KVCacheConfig:
    """1 full + 3 sliding-window layers (vLLM groups them 1 + 1 + 1 + 1) and a sink layer with a
    larger page, padded: float32 so the byte patterns stay exact."""
    layer_specs: dict[str, KVCacheSpec] = {}
    for i in range(4):
        if i == 2:
            layer_specs[f"l{i}"] = FullAttentionSpec(2, 2, 3, "float32")
        else:
            layer_specs[f"l{i}"] = SlidingWindowSpec(2, 2, 3, "float32", sliding_window=4)
    layer_specs["l4"] = ChunkedLocalAttentionSpec(2, 1, 4, "float32", attention_chunk_size=4)
    return get_kv_cache_config(layer_specs, num_blocks=num_blocks)


def _view_bytes(kv: KVCacheTensors, group_idx: int, block_id: int) -> set[int]:
    """The pool byte offsets block ``block_id``'s views in group ``group_idx`` cover."""
    [raw] = kv.raw_tensors
    raw.zero_()
    for view in kv.block_view(group_idx, block_id):
        view.view(torch.uint8).fill_(1)
    return set(raw.nonzero().flatten().tolist())


def test_small_hybrid_groups_each_have_their_own_views_of_one_pool() -> None:
    config = small_hybrid_config()
    assert [(get_kv_cache_spec_kind(g.kv_cache_spec).value, g.layer_names) for g in config.kv_cache_groups] == [
        ("sliding_window", ("l0",)),
        ("sliding_window", ("l1",)),
        ("sliding_window", ("l3",)),
        ("full_attention", ("l2",)),
        ("chunked_local_attention", ("l4",)),
    ]
    # The chunked layer's page (2 * 2 tokens * 1 head * 4 * 4 = 64 bytes) is padded to 96.
    assert config.kv_cache_groups[4].kv_cache_spec.page_size_padded == 96
    assert config.block_bytes == 96


def test_no_two_live_views_overlap_and_every_view_stays_in_its_block() -> None:
    kv = allocate_kv_cache_tensors(small_hybrid_config(), CPU)
    covered = {(g, b): _view_bytes(kv, g, b) for g in range(kv.num_groups) for b in range(kv.num_blocks)}
    for (g, b), offsets in covered.items():
        assert len(offsets) == (2 * 2 * 2 * 3 * 4 if g < 4 else 64)  # the real page, padding excluded
        for (g2, b2), offsets2 in covered.items():
            if b2 != b:
                assert not offsets & offsets2, f"group {g} block {b} overlaps group {g2} block {b2}"


def test_distinct_bytes_through_every_group_and_block_view_read_back_unchanged() -> None:
    kv = allocate_kv_cache_tensors(small_hybrid_config(num_blocks=11), CPU)
    # A block id is one group's at a time: give block b to group b % num_groups, write every view.
    owners = {b: b % kv.num_groups for b in range(1, kv.num_blocks)}
    written = {}
    for b, g in owners.items():
        for i, view in enumerate(kv.block_view(g, b)):
            values = torch.arange(view.numel(), dtype=torch.float32).reshape(view.shape) + 1000 * b + 100 * i
            view.copy_(values)
            written[(b, i)] = values
    for b, g in owners.items():
        for i, view in enumerate(kv.block_view(g, b)):
            assert torch.equal(view, written[(b, i)])
    (null_block,) = kv.block_view(0, 0)
    assert not null_block.any()


def test_attention_block_view_is_k_then_v_per_token_and_head() -> None:
    kv = allocate_kv_cache_tensors(tiny_attention_config(num_blocks=5), CPU)
    (view,) = kv.block_view(0, 3)
    assert tuple(view.shape) == (3, 4, 2, 16)  # [L, B, H, K|V]
    view[..., :8].fill_(1.0)  # K
    view[..., 8:].fill_(2.0)  # V
    (cache,) = kv.tensors(0)
    assert (cache[:, 3, ..., :8] == 1.0).all() and (cache[:, 3, ..., 8:] == 2.0).all()
    assert not cache[:, [0, 1, 2, 4]].any()


def test_mla_and_mamba_block_views_write_their_block() -> None:
    config = make_config(
        make_group(MLAAttentionSpec(4, 1, 24, "bfloat16"), 2, "mla"),
        make_group(MAMBA_SPEC, 2, "mamba"),
        num_blocks=4,
    )
    kv = allocate_kv_cache_tensors(config, CPU)

    (latent,) = kv.block_view(0, 2)
    assert tuple(latent.shape) == (2, 4, 24)
    latent.fill_(3.0)
    (state,) = kv.block_view(1, 1)
    assert tuple(state.shape) == (2, 9728 // 4)
    state.fill_(5)

    (mla_cache,) = kv.tensors(0)
    # Block 1 is the Mamba group's now: the MLA group's view of block 1 aliases it.
    assert (mla_cache[:, 2] == 3.0).all() and not mla_cache[:, [0, 3]].any()
    (mamba_cache,) = kv.tensors(1)
    assert (mamba_cache[:, 1] == 5).all() and not mamba_cache[:, [0, 3]].any()


def test_block_view_rejects_bad_indices() -> None:
    kv = allocate_kv_cache_tensors(tiny_attention_config(num_blocks=5), CPU)
    with pytest.raises(IndexError, match=r"block_id must be in \[0, 5\); got 5"):
        kv.block_view(0, 5)
    with pytest.raises(IndexError, match="block_id"):
        kv.block_view(0, -1)
    with pytest.raises(IndexError, match=r"group_idx must be in \[0, 1\); got 1"):
        kv.tensors(1)


def test_describe_names_device_kind_shape_dtype_and_bytes() -> None:
    kv = allocate_kv_cache_tensors(tiny_attention_config(num_blocks=5), CPU)
    text = kv.describe()
    assert "on cpu" in text
    assert "group 0 full_attention (3 layers): [3, 5, 4, 2, 16] float32" in text
    assert "1536 bytes (1.5 KiB)/block" in text
    assert "7680 bytes (7.5 KiB)" in text  # total


def test_constructor_rejects_a_pool_that_does_not_match_the_config() -> None:
    config = tiny_attention_config(num_blocks=5)
    with pytest.raises(ValueError, match="the pool tensor has 7679 bytes; the config needs 7680"):
        KVCacheTensors(config, [torch.zeros(7679, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="must be 1-D uint8 or int8"):
        KVCacheTensors(config, [torch.zeros(7680, dtype=torch.float32)])
    with pytest.raises(ValueError, match="one flat pool tensor; got 0"):
        KVCacheTensors(config, [])


def test_every_byte_comes_from_the_given_allocator() -> None:
    calls = []

    def allocator(num_bytes: int, device: torch.device) -> torch.Tensor:
        calls.append((num_bytes, device))
        return torch.full((num_bytes,), 7, dtype=torch.uint8)

    kv = allocate_kv_cache_tensors(small_hybrid_config(), CPU, allocator=allocator)
    assert calls == [(6 * 96, CPU)]
    [raw] = kv.raw_tensors
    assert (raw == 7).all()
    for g in range(kv.num_groups):
        for view in kv.tensors(g):
            assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


# ------------------------------------------------------------------------------------------------
# Sizing from a budget
# ------------------------------------------------------------------------------------------------


def test_num_blocks_from_budget_exact() -> None:
    llama = get_preset("llama-3-8b").kv_cache_groups()
    assert num_blocks_from_budget(llama, 10 * 2_097_152) == 10
    assert num_blocks_from_budget(llama, 10 * 2_097_152 + 2_097_151) == 10
    assert num_blocks_from_budget(llama, 2 * 2_097_152) == 2


def test_num_blocks_from_budget_too_small_names_budget_block_bytes_and_minimum() -> None:
    llama = get_preset("llama-3-8b").kv_cache_groups()
    with pytest.raises(ValueError) as excinfo:
        num_blocks_from_budget(llama, 2 * 2_097_152 - 1)
    message = str(excinfo.value)
    assert "4194303 bytes" in message  # the budget
    assert "2097152 bytes" in message  # bytes per block
    assert "4194304 bytes" in message  # the minimum budget
    with pytest.raises(ValueError, match="at least one"):
        num_blocks_from_budget((), 1 << 30)


def test_budget_sized_config_fits_its_budget() -> None:
    groups = tiny_attention_config().kv_cache_groups
    budget = 100_000
    config = KVCacheConfig(num_blocks_from_budget(groups, budget), groups)
    kv = allocate_kv_cache_tensors(config, META)
    assert kv.total_bytes <= budget < kv.total_bytes + kv.bytes_per_block()


def test_cuda_memory_budget_validates_fraction_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="needs a CUDA device; device is cpu"):
        cuda_memory_budget(CPU, 0.9)
    for fraction in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="fraction must be in"):
            cuda_memory_budget(torch.device("cuda", 0), fraction)

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 4000))
    assert cuda_memory_budget(torch.device("cuda", 0), 0.5) == 500
    assert cuda_memory_budget(torch.device("cuda", 0), 1.0) == 1000


# ------------------------------------------------------------------------------------------------
# Allocation failures and the meta device
# ------------------------------------------------------------------------------------------------


def test_allocation_that_cannot_fit_raises_with_bytes_asked_and_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_available_cpu_memory_bytes", lambda: 5000)
    config = tiny_attention_config(num_blocks=5)  # 5 * 1536 = 7680 bytes

    with pytest.raises(KVCacheAllocationError) as excinfo:
        allocate_kv_cache_tensors(config, CPU)
    error = excinfo.value
    assert isinstance(error, MemoryError)
    assert (error.bytes_asked, error.bytes_available, error.device) == (7680, 5000, CPU)
    assert "asked 7680 bytes (7.5 KiB)" in str(error)
    assert "available 5000 bytes (4.9 KiB)" in str(error)


def test_allocation_that_fits_the_available_memory_goes_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_available_cpu_memory_bytes", lambda: 7680)
    kv = allocate_kv_cache_tensors(tiny_attention_config(num_blocks=5), CPU)
    assert kv.total_bytes == 7680


def test_torch_out_of_memory_is_reraised_with_the_same_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_zeros(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(memory, "_available_cpu_memory_bytes", lambda: 1 << 40)
    monkeypatch.setattr(torch, "zeros", failing_zeros)
    with pytest.raises(KVCacheAllocationError, match="asked 7680 bytes .* available 1099511627776 bytes") as excinfo:
        allocate_kv_cache_tensors(tiny_attention_config(num_blocks=5), CPU)
    assert isinstance(excinfo.value.__cause__, RuntimeError)


def test_other_allocation_errors_propagate_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_zeros(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("something else")

    monkeypatch.setattr(torch, "zeros", failing_zeros)
    with pytest.raises(RuntimeError, match="something else"):
        allocate_kv_cache_tensors(tiny_attention_config(), CPU)


def test_available_cpu_memory_reads_proc_meminfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    try:
        import psutil  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("psutil is installed and takes precedence over /proc/meminfo")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4096 kB\nMemFree:         100 kB\nMemAvailable:    2048 kB\n")
    monkeypatch.setattr(memory, "_PROC_MEMINFO", str(meminfo))
    assert memory._available_cpu_memory_bytes() == 2048 * 1024
    monkeypatch.setattr(memory, "_PROC_MEMINFO", str(tmp_path / "missing"))
    assert memory._available_cpu_memory_bytes() is None


def _config_with_every_layout() -> KVCacheConfig:
    """Attention (two heads), MLA and Mamba groups in one pool."""
    return make_config(
        make_group(FullAttentionSpec(4, num_kv_heads=2, head_size=8, dtype="bfloat16"), 2, "a"),
        make_group(MLAAttentionSpec(4, num_kv_heads=1, head_size=16, dtype="float16"), 1, "m"),
        make_group(MAMBA_SPEC, 2, "s"),
        num_blocks=6,
    )


@pytest.mark.parametrize("preset_name", ["llama-3-8b", "gemma-3-27b", "deepseek-v3", "llama-4-scout"])
def test_the_meta_pool_made_without_torch_is_the_one_torch_makes(preset_name: str) -> None:
    """``allocate_kv_cache_tensors(config, "meta")`` (no torch until a view is asked for) gives the
    views, dtypes, sizes and description of the pool built eagerly on ``torch.device("meta")``."""
    for config in (get_preset(preset_name).kv_cache_config(9, block_size=16), _config_with_every_layout()):
        lazy, eager = allocate_kv_cache_tensors(config, "meta"), allocate_kv_cache_tensors(config, META)
        assert (lazy.device_type, lazy.device_name) == (eager.device_type, eager.device_name) == ("meta", "meta")
        assert lazy.num_groups == eager.num_groups == len(config.kv_cache_groups)
        for g in range(lazy.num_groups):
            expected = eager.dtype(g)
            assert lazy.dtype_name(g) == (None if expected is None else str(expected).removeprefix("torch."))
            assert lazy.block_dims(g) == eager.block_dims(g)
            assert lazy.bytes_per_block(g) == eager.bytes_per_block(g)
        assert lazy.describe() == eager.describe()  # from the config alone: no view built yet
        assert lazy.device == META and lazy._views is None
        for g in range(lazy.num_groups):
            assert [(t.shape, t.stride(), t.dtype, t.storage_offset()) for t in lazy.tensors(g)] == [
                (t.shape, t.stride(), t.dtype, t.storage_offset()) for t in eager.tensors(g)
            ]
        assert lazy.raw_tensors[0].numel() == eager.raw_tensors[0].numel()


def test_dtype_names_of_every_layout_on_cpu() -> None:
    kv = allocate_kv_cache_tensors(_config_with_every_layout(), CPU)
    assert [kv.dtype_name(g) for g in range(3)] == ["bfloat16", "float16", "uint8"]
    assert [str(kv.dtype(g)) for g in range(3)] == ["torch.bfloat16", "torch.float16", "torch.uint8"]
    assert (kv.device_type, kv.device_name) == ("cpu", "cpu")
    with pytest.raises(IndexError, match=r"group_idx must be in \[0, 3\); got 3"):
        kv.dtype_name(3)


def test_meta_device_allocates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # No available-memory check applies to meta: even "0 bytes free" on the host lets it through.
    monkeypatch.setattr(memory, "_available_cpu_memory_bytes", lambda: 0)
    num_blocks = 100_000  # 200 GiB of llama-3-8b KV cache, were it real
    kv = allocate_kv_cache_tensors(get_preset("llama-3-8b").kv_cache_config(num_blocks), "meta")

    assert kv.device == META
    assert all(t.is_meta for t in kv.tensors(0))
    assert kv.total_bytes == num_blocks * 2_097_152
    assert "meta: shapes only, nothing allocated" in kv.describe()
    (view,) = kv.block_view(0, num_blocks - 1)
    assert view.is_meta and tuple(view.shape) == (32, 16, 8, 256)


# ------------------------------------------------------------------------------------------------
# Devices and dtypes
# ------------------------------------------------------------------------------------------------


def test_resolve_device_plain_values() -> None:
    assert resolve_device("cpu") == CPU
    assert resolve_device(" CPU ") == CPU
    assert resolve_device("meta") == META


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answers")
def test_resolve_device_without_cuda() -> None:
    assert resolve_device("auto") == CPU
    for value in ("cuda", "cuda:0", "cuda:3"):
        expected = rf"device '{value}' needs CUDA, which is not available; available: auto, cpu, meta"
        with pytest.raises(ValueError, match=expected):
            resolve_device(value)


@pytest.mark.parametrize("value", ["", "gpu", "tpu", "cuda:x", "cuda:-1", "cpu:0", "cuda:0:1"])
def test_resolve_device_rejects_unknown_values(value: str) -> None:
    expected = r"device must be one of auto, cpu, cuda, cuda:N, meta; got .* \(available: auto, cpu"
    with pytest.raises(ValueError, match=expected):
        resolve_device(value)


def test_resolve_device_with_cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    expected = r"device 'cuda:2': no such CUDA device \(2 present\); available: .*cuda:0, cuda:1"
    with pytest.raises(ValueError, match=expected):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", sorted(DTYPE_SIZE_BYTES))
def test_torch_dtype_for_every_dtype_name(name: str) -> None:
    dtype = torch_dtype(name)
    assert isinstance(dtype, torch.dtype)
    assert dtype.itemsize == DTYPE_SIZE_BYTES[name]
    assert str(dtype) == f"torch.{name}"


def test_torch_dtype_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        torch_dtype("float64")


# ------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocation_budget_and_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    device = resolve_device("cuda")
    assert resolve_device("auto") == device

    kv = allocate_kv_cache_tensors(tiny_attention_config(num_blocks=5), "cuda")
    assert kv.device == device and kv.tensors(0)[0].is_cuda
    (view,) = kv.block_view(0, 2)
    view.fill_(4.0)
    (cache,) = kv.tensors(0)
    assert (cache[:, :, 2] == 4.0).all() and not cache[:, :, [0, 1, 3, 4]].any()

    budget = cuda_memory_budget(device, 0.5)
    free_bytes, _ = torch.cuda.mem_get_info(device)
    assert 0 < budget <= free_bytes // 2 + 1

    # 8 layers x [2, 16, 8, 128] float32 = 1 MiB per block; ask for more than is free.
    groups = (make_group(FullAttentionSpec(16, 8, 128, "float32"), 8),)
    num_blocks = free_bytes // (1 << 20) + 1024
    too_big = KVCacheConfig(num_blocks, groups)
    with pytest.raises(KVCacheAllocationError, match=f"asked {num_blocks << 20} bytes"):
        allocate_kv_cache_tensors(too_big, device)  # refused by the check, nothing allocated

    # Skip the check so torch itself runs out of memory; the error must read the same.
    monkeypatch.setattr(memory, "_available_memory_bytes", lambda device: None)
    with pytest.raises(KVCacheAllocationError, match=f"asked {num_blocks << 20} bytes") as excinfo:
        allocate_kv_cache_tensors(too_big, device)
    assert excinfo.value.__cause__ is not None
    assert torch.cuda.memory_allocated(device) < 1 << 30  # the failed allocation left nothing behind
