"""KV cache tensors in device memory, sized from a :class:`~kvservice.core.kv_cache_spec.KVCacheConfig`.

This module and the server are the only places that import torch, and only where memory is
allocated or viewed: on ``meta`` (the replay's default) nothing imports it, since the pool's
shapes, dtypes and sizes come from the config alone (its views are built on first use). The core
hands out block ids; this module holds the memory those ids name: one flat pool of ``num_blocks * bytes_per_block``
bytes that every KV cache group views, as vLLM 0.33's hybrid allocator lays it out (placement from
:mod:`kvservice.core.kv_cache_planning`; block 0, the null block, is allocated like any other block
and never written by a model). Every byte comes from one allocator call
(:func:`allocate_kv_cache_tensors`'s ``allocator``); the per-group views are strided views of that
flat tensor (:class:`KVCacheTensors` gives their shapes).

Sizing: :func:`num_blocks_from_budget` turns a byte budget (for CUDA, :func:`cuda_memory_budget`,
``--gpu-memory-utilization``-style) into ``num_blocks``; :func:`allocate_kv_cache_tensors` checks the
total fits before allocating and fails at start with :class:`KVCacheAllocationError` otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvservice.core.kv_cache_planning import KVCacheTensor, get_num_blocks
from kvservice.core.kv_cache_spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    OpaqueSpec,
    SlidingWindowMLASpec,
    dtype_size_bytes,
    get_kv_cache_spec_kind,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "KVCacheAllocationError",
    "KVCacheAllocator",
    "KVCacheTensors",
    "allocate_kv_cache_tensors",
    "allocate_zeroed",
    "cuda_memory_budget",
    "is_meta_device",
    "num_blocks_from_budget",
    "resolve_device",
    "torch_dtype",
]

_DEVICE_CHOICES = "auto, cpu, cuda, cuda:N, meta"
_CUDA_INDEX_RE = re.compile(r"cuda:(\d+)")
_PROC_MEMINFO = "/proc/meminfo"


class KVCacheAllocationError(MemoryError):
    """The KV cache does not fit on its device.

    The message gives the bytes asked, the bytes available and the device.

    Attributes:
        bytes_asked: bytes the KV cache tensors need.
        bytes_available: bytes the device had free (None when unknown).
        device: the device the tensors were to live on.
    """

    def __init__(self, bytes_asked: int, bytes_available: int | None, device: torch.device) -> None:
        self.bytes_asked = bytes_asked
        self.bytes_available = bytes_available
        self.device = device
        available = "unknown" if bytes_available is None else _format_bytes(bytes_available)
        super().__init__(
            f"KV cache does not fit on {device}: asked {_format_bytes(bytes_asked)}, "
            f"available {available}; lower num_blocks or the memory budget"
        )


# --------------------------------------------------------------------------------------------------
# Devices and dtypes
# --------------------------------------------------------------------------------------------------


def _describe_available_devices() -> str:
    """A human list of the device values that would resolve here."""
    import torch

    choices = ["auto", "cpu", "meta"]
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        choices.append("cuda")
        choices.extend(f"cuda:{i}" for i in range(count))
    else:
        choices.append("(no CUDA device)")
    return ", ".join(choices)


def is_meta_device(device: torch.device | str) -> bool:
    """Whether ``device`` (a torch device or a :func:`resolve_device` value) is ``meta``, decided
    without importing torch."""
    return device.strip().lower() == "meta" if isinstance(device, str) else device.type == "meta"


def resolve_device(spec: str) -> torch.device:
    """The torch device named by a ``--device`` value.

    Args:
        spec: ``"auto"`` (the current CUDA device when CUDA is available, else CPU), ``"cpu"``,
            ``"cuda"`` (the current CUDA device), ``"cuda:N"`` or ``"meta"`` (shapes and dtypes
            only, no storage: for running the service where no model runs). Surrounding whitespace
            and case are ignored.

    Returns:
        The device, with an explicit index for CUDA (``cuda:0`` rather than ``cuda``).

    Raises:
        ValueError: ``spec`` is none of the above, or names CUDA (or a CUDA index) this machine
            does not have. The message names ``device`` and lists what is available.
    """
    import torch

    value = str(spec).strip().lower()
    if value == "cpu":
        return torch.device("cpu")
    if value == "meta":
        return torch.device("meta")
    if value == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if value == "cuda" or _CUDA_INDEX_RE.fullmatch(value):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {spec!r} needs CUDA, which is not available; available: {_describe_available_devices()}"
            )
        index = torch.cuda.current_device() if value == "cuda" else int(value.split(":", 1)[1])
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r}: no such CUDA device ({torch.cuda.device_count()} present); "
                f"available: {_describe_available_devices()}"
            )
        return torch.device("cuda", index)
    raise ValueError(
        f"device must be one of {_DEVICE_CHOICES}; got {spec!r} (available: {_describe_available_devices()})"
    )


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (a key of :data:`~kvservice.core.kv_cache_spec.DTYPE_SIZE_BYTES`).

    Raises:
        ValueError: unknown dtype name (lists the known ones).
    """
    import torch

    size_bytes = dtype_size_bytes(name)  # raises ValueError for unknown names
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not available in torch {torch.__version__}")
    assert dtype.itemsize == size_bytes, (
        f"DTYPE_SIZE_BYTES[{name!r}] = {size_bytes} but torch's {dtype} has {dtype.itemsize} bytes"
    )
    return dtype


# --------------------------------------------------------------------------------------------------
# Views: one strided view per KV cache tensor over the shared pool
# --------------------------------------------------------------------------------------------------


def _page_layout(spec: KVCacheSpec) -> tuple[tuple[int, ...], str]:
    """The shape and dtype name (torch's, a key of ``DTYPE_SIZE_BYTES``) of one layer's page of
    ``spec`` (one block), padding excluded. Needs no torch."""
    if isinstance(spec, OpaqueSpec):
        return (spec.opaque_bytes,), "uint8"
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        if spec.num_kv_heads != 1:
            raise ValueError(
                f"an MLA spec holds one latent per token, so num_kv_heads must be 1; got {spec.num_kv_heads}"
            )
        dtype_size_bytes(spec.dtype)  # raises ValueError for unknown names
        return (spec.block_size, spec.head_size), spec.dtype
    if isinstance(spec, AttentionSpec):
        # vLLM 0.33's LBNHC page: per token, per KV head, K (head_size) then V (head_size).
        dtype_size_bytes(spec.dtype)
        return (spec.block_size, spec.num_kv_heads, 2 * spec.head_size), spec.dtype
    if isinstance(spec, MambaSpec):
        if len(spec.shapes) != len(spec.dtypes):
            raise ValueError(
                f"a MambaSpec needs one dtype per state shape; got {len(spec.shapes)} shapes "
                f"and {len(spec.dtypes)} dtypes"
            )
        return (spec.real_page_size_bytes,), "uint8"
    raise ValueError(f"no tensor layout for KV cache spec {type(spec).__name__}")


def _check_placement(tensor: KVCacheTensor) -> None:
    """``tensor``'s offset and strides are whole elements of its dtype (a view can be built).

    Raises:
        ValueError: one is not; the message names the layer, the field and the bytes.
    """
    itemsize = dtype_size_bytes(_page_layout(tensor.kv_cache_spec)[1])
    for what, value in (
        ("offset", tensor.offset),
        ("layer_stride", tensor.layer_stride),
        ("block_stride", tensor.block_stride),
    ):
        if value % itemsize:
            raise ValueError(
                f"KV cache tensor of {tensor.layer_names[0]}: {what} {value} bytes is not a multiple of "
                f"its dtype's {itemsize} bytes"
            )


def _tensor_view(raw: torch.Tensor, tensor: KVCacheTensor, num_blocks: int) -> torch.Tensor:
    """``[L, num_blocks, *page shape]`` over ``raw`` (a flat byte tensor) as ``tensor`` places it."""
    page_shape, dtype_name = _page_layout(tensor.kv_cache_spec)
    _check_placement(tensor)
    dtype = torch_dtype(dtype_name)
    itemsize = dtype.itemsize
    usable = raw.numel() - raw.numel() % itemsize
    typed = raw[:usable].view(dtype)
    inner_strides = []
    stride = 1
    for dim in reversed(page_shape):
        inner_strides.append(stride)
        stride *= dim
    strides = (tensor.layer_stride // itemsize, tensor.block_stride // itemsize, *reversed(inner_strides))
    shape = (tensor.num_layers, num_blocks, *page_shape)
    return typed.as_strided(shape, strides, typed.storage_offset() + tensor.offset // itemsize)


# --------------------------------------------------------------------------------------------------
# The tensors
# --------------------------------------------------------------------------------------------------


class KVCacheTensors:
    """The KV cache memory: one flat pool that every KV cache group views (vLLM 0.33's hybrid
    allocator), indexed by block id.

    The pool holds ``num_blocks * bytes_per_block()`` bytes, ``bytes_per_block()`` being the largest
    group's sum of per-layer pages (``KVCacheConfig.block_bytes``), so one block id costs one
    group's page. Every group's layers alias the pool from byte 0: a block id is owned by one group
    at a time, and a group's view of block ``b`` never overlaps another group's view of a different
    block. Placement (strides, offsets) comes from
    :func:`kvservice.core.kv_cache_planning.get_kv_cache_tensors`; per KV cache tensor (a run of
    same-spec layers of one group; ``L`` = its layers, ``N`` = ``num_blocks``, ``B`` = block size in
    tokens, ``H`` = KV heads, ``D`` = head size in elements), :meth:`tensors` gives one strided view:

    - attention kinds (full, sink full, sliding window, chunked local, cross, encoder-only):
      ``[L, N, B, H, 2 * D]``; the last axis holds K (``[:D]``) then V (``[D:]``) (vLLM's
      ``LBNHC`` page: token, head, K|V);
    - MLA kinds: ``[L, N, B, D]`` (one latent of ``D`` elements per token);
    - Mamba: ``[L, N, page bytes]`` in ``uint8`` (the state tensors packed in the spec's order).

    The block axis is 1 everywhere; block 0 is the null block. Padding (``page_size_padded``) is
    in the stride, not in the view.

    Args:
        config: the config the pool was sized from.
        raw_tensors: the flat backing allocation(s): one 1-D ``uint8`` (or ``int8``) tensor of at
            least ``config.total_bytes`` bytes (every KV cache tensor of vLLM 0.33's plan shares
            one). :func:`allocate_kv_cache_tensors` makes it; pass your own to wrap memory
            allocated elsewhere (e.g. shared memory).

    Raises:
        ValueError: ``raw_tensors`` is not one flat byte tensor of at least the pool's size, or a
            spec has no tensor layout.

    :meth:`on_meta` makes the ``meta`` pool without torch: everything but the views (and
    :attr:`raw_tensors`, :attr:`device`) comes from the config; the views, ``meta`` tensors, are
    built when first asked for.
    """

    def __init__(self, config: KVCacheConfig, raw_tensors: Sequence[torch.Tensor]) -> None:
        import torch

        raw_tensors = tuple(raw_tensors)
        if len(raw_tensors) != 1:
            raise ValueError(f"raw_tensors must hold one flat pool tensor; got {len(raw_tensors)}")
        [raw] = raw_tensors
        if raw.dim() != 1 or raw.dtype not in (torch.uint8, torch.int8):
            raise ValueError(f"the pool tensor must be 1-D uint8 or int8; got {raw.dtype} of shape {list(raw.shape)}")
        if raw.numel() < config.total_bytes:
            raise ValueError(f"the pool tensor has {raw.numel()} bytes; the config needs {config.total_bytes}")
        self._set_config(config)
        self._raw: torch.Tensor | None = raw.view(torch.uint8)
        self._device_name = str(raw.device)
        self._device_type = raw.device.type
        self._views: tuple[tuple[torch.Tensor, ...], ...] | None = self._build_views(self._raw)

    @classmethod
    def on_meta(cls, config: KVCacheConfig) -> KVCacheTensors:
        """The pool of ``config`` on the ``meta`` device (shapes and dtypes only, no storage),
        made without importing torch; the views are built (torch imported) on first use.

        Raises:
            ValueError: a spec has no tensor layout, or a tensor's placement is not in whole
                elements of its dtype.
        """
        self = cls.__new__(cls)
        for tensor in config.kv_cache_tensors:
            _page_layout(tensor.kv_cache_spec)
            _check_placement(tensor)
        self._set_config(config)
        self._raw = None
        self._device_name = self._device_type = "meta"
        self._views = None
        return self

    def _set_config(self, config: KVCacheConfig) -> None:
        self._config = config
        self._kv_cache_tensors = config.kv_cache_tensors
        dtype_names: list[list[str]] = [[] for _ in config.kv_cache_groups]
        for tensor in self._kv_cache_tensors:
            dtype_names[tensor.group_idx].append(_page_layout(tensor.kv_cache_spec)[1])
        self._dtype_names = tuple(tuple(names) for names in dtype_names)

    def _build_views(self, raw: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
        views: list[list[torch.Tensor]] = [[] for _ in self._config.kv_cache_groups]
        for tensor in self._kv_cache_tensors:
            views[tensor.group_idx].append(_tensor_view(raw, tensor, self._config.num_blocks))
        return tuple(tuple(v) for v in views)

    def _pool(self) -> tuple[torch.Tensor, tuple[tuple[torch.Tensor, ...], ...]]:
        """The flat pool and the views (built now on a :meth:`on_meta` pool's first use)."""
        if self._raw is None or self._views is None:
            import torch

            self._raw = torch.empty(self._config.total_bytes, dtype=torch.uint8, device="meta")
            self._views = self._build_views(self._raw)
        return self._raw, self._views

    @property
    def config(self) -> KVCacheConfig:
        """The config the tensors were sized from."""
        return self._config

    @property
    def raw_tensors(self) -> tuple[torch.Tensor, ...]:
        """The flat ``uint8`` backing allocation(s) every view aliases (one: the pool)."""
        return (self._pool()[0],)

    @property
    def kv_cache_tensors(self) -> tuple[KVCacheTensor, ...]:
        """Per KV cache tensor: its group, layers, spec, size, strides and offset in the pool."""
        return self._kv_cache_tensors

    @property
    def num_groups(self) -> int:
        """KV cache groups."""
        return len(self._dtype_names)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (the size of every view's block axis), block 0 included."""
        return self._config.num_blocks

    @property
    def device(self) -> torch.device:
        """The device the pool lives on (imports torch; :attr:`device_type` and :attr:`device_name`
        do not)."""
        if self._raw is None:
            import torch

            return torch.device(self._device_name)
        return self._raw.device

    @property
    def device_type(self) -> str:
        """The device's type: ``"cpu"``, ``"cuda"`` or ``"meta"`` (no torch needed)."""
        return self._device_type

    @property
    def device_name(self) -> str:
        """The device as torch writes it (``"cpu"``, ``"cuda:0"``, ``"meta"``; no torch needed)."""
        return self._device_name

    def _check_group_idx(self, group_idx: int) -> None:
        if not 0 <= group_idx < len(self._dtype_names):
            raise IndexError(f"group_idx must be in [0, {len(self._dtype_names)}); got {group_idx}")

    def tensors(self, group_idx: int) -> tuple[torch.Tensor, ...]:
        """Group ``group_idx``'s views, one per KV cache tensor of the group (layouts in the class
        docstring).

        Raises:
            IndexError: no such group.
        """
        self._check_group_idx(group_idx)
        return self._pool()[1][group_idx]

    def block_dims(self, group_idx: int) -> tuple[int, ...]:
        """Per view of group ``group_idx``, the axis a block id indexes (1 for every view).

        Raises:
            IndexError: no such group.
        """
        self._check_group_idx(group_idx)
        return tuple(1 for _ in self._dtype_names[group_idx])

    def bytes_per_block(self, group_idx: int | None = None) -> int:
        """Bytes of one block id.

        Args:
            group_idx: a group: the bytes its layers use of a block (``KVCacheGroupSpec.block_bytes``);
                None: what a block id costs in the pool (the largest group's, ``KVCacheConfig.block_bytes``).

        Raises:
            IndexError: no such group.
        """
        if group_idx is None:
            return self._config.block_bytes
        self._check_group_idx(group_idx)
        return self._config.kv_cache_groups[group_idx].block_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the pool (``num_blocks * bytes_per_block()``); on ``meta``, the nominal size,
        none of it allocated."""
        return self._config.total_bytes

    def dtype(self, group_idx: int) -> torch.dtype | None:
        """The dtype of group ``group_idx``'s views; None when they differ.

        Raises:
            IndexError: no such group.
        """
        dtypes = set(self.dtypes(group_idx))
        return dtypes.pop() if len(dtypes) == 1 else None

    def dtypes(self, group_idx: int) -> tuple[torch.dtype, ...]:
        """The dtype of each of group ``group_idx``'s views.

        Raises:
            IndexError: no such group.
        """
        return tuple(t.dtype for t in self.tensors(group_idx))

    def dtype_name(self, group_idx: int) -> str | None:
        """:meth:`dtype` as torch names it without the ``torch.`` prefix (``"bfloat16"``,
        ``"uint8"``), from the specs (no torch needed); None when the views' dtypes differ or
        the group has no tensors.

        Raises:
            IndexError: no such group.
        """
        self._check_group_idx(group_idx)
        names = set(self._dtype_names[group_idx])
        return names.pop() if len(names) == 1 else None

    def block_view(self, group_idx: int, block_id: int) -> tuple[torch.Tensor, ...]:
        """Block ``block_id``'s memory in group ``group_idx``'s layers: one view per KV cache tensor
        of the group, shaped as :meth:`tensors` without the block axis (``[L, B, H, 2 * D]``,
        ``[L, B, D]`` or ``[L, page bytes]``).

        The views share memory with the pool: writing them writes the block. Views of another
        group's block ``block_id`` alias the same bytes (a block id is one group's at a time).

        Raises:
            IndexError: no such group, or ``block_id`` is not in ``[0, num_blocks)``.
        """
        views = self.tensors(group_idx)
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id must be in [0, {self.num_blocks}); got {block_id}")
        return tuple(view[:, block_id] for view in views)

    def describe(self) -> str:
        """A short human summary: the device and pool size, then per group its kind, layers and
        bytes per block."""
        storage = " (meta: shapes only, nothing allocated)" if self._device_type == "meta" else ""
        lines = [
            f"KV cache on {self._device_name}{storage}: one pool of {self.num_blocks} blocks x "
            f"{_format_bytes(self.bytes_per_block())} = {_format_bytes(self.total_bytes)}, "
            f"{self.num_groups} groups viewing it"
        ]
        layouts: list[list[str]] = [[] for _ in self._config.kv_cache_groups]
        for tensor in self._kv_cache_tensors:  # the views' shapes, from the config (no torch needed)
            page_shape, dtype_name = _page_layout(tensor.kv_cache_spec)
            layouts[tensor.group_idx].append(f"{[tensor.num_layers, self.num_blocks, *page_shape]} {dtype_name}")
        for group_idx, (group, shapes_of_views) in enumerate(zip(self._config.kv_cache_groups, layouts)):
            kind = get_kv_cache_spec_kind(group.kv_cache_spec).value
            shapes = ", ".join(shapes_of_views)
            lines.append(
                f"  group {group_idx} {kind} ({group.num_layers} layers): {shapes or 'no tensors'}; "
                f"{_format_bytes(self.bytes_per_block(group_idx))}/block"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"KVCacheTensors(device={self._device_name}, num_groups={self.num_groups}, "
            f"num_blocks={self.num_blocks}, total_bytes={self.total_bytes})"
        )


# --------------------------------------------------------------------------------------------------
# Sizing and allocation
# --------------------------------------------------------------------------------------------------


def num_blocks_from_budget(groups: Sequence[KVCacheGroupSpec], budget_bytes: int) -> int:
    """How many block ids fit in ``budget_bytes``: ``budget_bytes // bytes per block id``, one block
    id costing the largest group's pages (vLLM 0.33's sizing; see
    :func:`kvservice.core.kv_cache_planning.get_num_blocks`), block 0 (the null block) included.

    Raises:
        ValueError: no groups, the groups occupy 0 bytes per block, or fewer than 2 blocks fit; the
            message names the budget, the bytes per block and the minimum budget.
    """
    return get_num_blocks(groups, budget_bytes)


def cuda_memory_budget(device: torch.device | str, fraction: float) -> int:
    """Bytes for the KV cache: ``fraction`` of the CUDA device's free memory now.

    ``--gpu-memory-utilization``-style sizing, except that the fraction applies to what is free
    when the service starts (``torch.cuda.mem_get_info``), not to the device's total memory: this
    service runs no model, so what others hold stays theirs.

    Args:
        device: a CUDA device (or a :func:`resolve_device` value naming one).
        fraction: the share of free memory to use, in ``(0, 1]``.

    Returns:
        ``int(fraction * free bytes)``.

    Raises:
        ValueError: ``fraction`` is outside ``(0, 1]``, or ``device`` is not a CUDA device (or CUDA
            is not available).
    """
    import torch

    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory fraction must be in (0, 1]; got {fraction}")
    resolved = resolve_device(device) if isinstance(device, str) else device
    if resolved.type != "cuda":
        raise ValueError(f"a memory fraction needs a CUDA device; device is {resolved} (give a byte budget instead)")
    free_bytes, _total_bytes = torch.cuda.mem_get_info(resolved)
    return int(fraction * free_bytes)


def _available_cpu_memory_bytes() -> int | None:
    """Host memory available for new allocations: psutil's ``available`` when psutil is installed,
    else ``MemAvailable`` from /proc/meminfo; None when neither is readable."""
    try:
        import psutil  # type: ignore[import-untyped]  # psutil ships no type information
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        with open(_PROC_MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB; it means KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _available_memory_bytes(device: torch.device) -> int | None:
    """Bytes free on ``device`` for new tensors; None when unknown or unbounded (``meta``)."""
    if device.type == "meta":
        return None
    if device.type == "cuda":
        import torch

        free_bytes, _total_bytes = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    if device.type == "cpu":
        return _available_cpu_memory_bytes()
    return None


def _is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is torch (or Python) failing to allocate memory."""
    import torch

    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):  # torch >= 2.5 aliases it as torch.OutOfMemoryError
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


KVCacheAllocator = Callable[[int, "torch.device"], "torch.Tensor"]
"""Makes a KV cache pool: ``(num_bytes, device) -> 1-D uint8 (or int8) tensor of num_bytes bytes``
(:func:`allocate_zeroed`, or :class:`kvservice.shm.SharedMemoryAllocator`: POSIX shared memory,
zero-filled by the kernel)."""


def allocate_zeroed(num_bytes: int, device: torch.device) -> torch.Tensor:
    """The default :data:`KVCacheAllocator`: ``torch.zeros(num_bytes, dtype=uint8)`` on ``device``
    (``torch.empty`` on ``meta``, which has no storage).

    Zeroing, not ``torch.empty`` (what vLLM uses), touches every page, so the memory is really
    committed (host RSS shows it) and an over-commit fails here, at start, rather than later under
    load or through the kernel's OOM killer. It costs one pass over the memory at start.
    """
    import torch

    if device.type == "meta":
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)
    return torch.zeros(num_bytes, dtype=torch.uint8, device=device)


def allocate_kv_cache_tensors(
    config: KVCacheConfig, device: torch.device | str, *, allocator: KVCacheAllocator | None = None
) -> KVCacheTensors:
    """Allocate the KV cache pool of ``config`` on ``device`` and view it per group.

    Every byte of the KV cache comes from one call of ``allocator`` (the pool all groups view);
    the views are built from that flat tensor, so another allocator (e.g. POSIX shared memory)
    changes where the memory lives and nothing else. The total (``config.total_bytes``) is checked
    against the device's free memory before anything is allocated (CPU: psutil or /proc/meminfo
    ``MemAvailable``; CUDA: ``torch.cuda.mem_get_info``; ``meta``: always fits, since nothing is
    allocated). An allocator failure that still happens is re-raised as the same error.

    ``device`` ``"meta"`` (the string) with the default allocator imports no torch: the pool is
    :meth:`KVCacheTensors.on_meta`.

    Args:
        config: the block count and groups to size the pool from.
        device: a torch device or a :func:`resolve_device` value (``"auto"``, ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``, ``"meta"``).
        allocator: makes the flat pool tensor (default :func:`allocate_zeroed`).

    Returns:
        The tensors, laid out as :class:`KVCacheTensors` documents.

    Raises:
        KVCacheAllocationError: the pool does not fit; the message gives the bytes asked and the
            bytes available.
        ValueError: a bad ``device`` value, a spec with no tensor layout, or an allocator that
            returned something other than a 1-D byte tensor of at least the pool's size.
    """
    if allocator is None and isinstance(device, str) and is_meta_device(device):
        return KVCacheTensors.on_meta(config)
    resolved = resolve_device(device) if isinstance(device, str) else device
    allocator = allocator or allocate_zeroed
    bytes_asked = config.total_bytes
    for tensor in config.kv_cache_tensors:  # a spec with no layout fails before any allocation
        _page_layout(tensor.kv_cache_spec)
        torch_dtype(_page_layout(tensor.kv_cache_spec)[1])
    bytes_available = _available_memory_bytes(resolved)
    if bytes_available is not None and bytes_asked > bytes_available:
        raise KVCacheAllocationError(bytes_asked, bytes_available, resolved)
    try:
        raw = allocator(bytes_asked, resolved)
    except Exception as exc:  # torch raises OutOfMemoryError on CUDA, RuntimeError on CPU
        if not _is_out_of_memory(exc):
            raise
        if resolved.type == "cuda":
            import torch

            torch.cuda.empty_cache()  # hand back what the partial allocation cached
        raise KVCacheAllocationError(bytes_asked, _available_memory_bytes(resolved), resolved) from exc
    return KVCacheTensors(config, [raw])


def _format_bytes(num_bytes: int) -> str:
    """``num_bytes`` exactly, with a binary-unit rendering when it is 1 KiB or more."""
    if abs(num_bytes) < 1024:
        return f"{num_bytes} bytes"
    value = float(num_bytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{num_bytes} bytes ({value:.1f} {unit})"
