"""KV cache tensors in device memory, sized from a :class:`~kvservice.core.kv_cache_spec.KVCacheConfig`.

This module and the server are the only places that import torch. The core hands out block ids;
this module holds the memory those ids name: for every KV cache group, tensors with a
``num_blocks`` dimension that a block id indexes (block 0, the null block, is allocated like any
other block and never written by a model).

Layouts (``L`` = the group's ``num_layers``, ``N`` = ``num_blocks``, ``B`` = ``block_size`` in
tokens, ``H`` = ``num_kv_heads``, ``D`` = ``head_size`` in elements; :class:`KVCacheTensors` has the
details):

- attention kinds (full, sink full, sliding window, chunked local, cross, encoder-only):
  ``[L, 2, N, B, H, D]`` (axis 1: 0 = K, 1 = V; block axis 2);
- MLA kinds: ``[L, N, B, D]`` (one latent per token; block axis 1);
- Mamba: per state tensor ``i``, ``[L, N, *shapes[i]]`` in ``dtypes[i]`` (block axis 1);
- ``UniformTypeKVCacheSpecs``: one tensor per inner (per-layer) spec, each in its layout with ``L = 1``.

Sizing: :func:`num_blocks_from_budget` turns a byte budget (for CUDA, :func:`cuda_memory_budget`,
``--gpu-memory-utilization``-style) into ``num_blocks``; :func:`allocate_kv_cache_tensors` checks the
total fits before allocating and fails at start with :class:`KVCacheAllocationError` otherwise.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvservice.core.kv_cache_spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
    dtype_size_bytes,
    get_kv_cache_spec_kind,
)

__all__ = [
    "Allocator",
    "KVCacheAllocationError",
    "KVCacheTensors",
    "allocate_kv_cache_tensors",
    "cuda_memory_budget",
    "num_blocks_from_budget",
    "resolve_device",
    "torch_dtype",
]

Allocator = Callable[[int, torch.device], torch.Tensor]
"""Where raw KV memory comes from: ``(num_bytes, device) -> a flat uint8 tensor of num_bytes bytes``
on ``device`` (e.g. :class:`kvservice.shm.SharedMemoryAllocator`: POSIX shared memory). Its
contents need not be zero; :func:`allocate_kv_cache_tensors` zero-fills what it gets."""

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
    choices = ["auto", "cpu", "meta"]
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        choices.append("cuda")
        choices.extend(f"cuda:{i}" for i in range(count))
    else:
        choices.append("(no CUDA device)")
    return ", ".join(choices)


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
    size_bytes = dtype_size_bytes(name)  # raises ValueError for unknown names
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not available in torch {torch.__version__}")
    assert dtype.itemsize == size_bytes, (
        f"DTYPE_SIZE_BYTES[{name!r}] = {size_bytes} but torch's {dtype} has {dtype.itemsize} bytes"
    )
    return dtype


# --------------------------------------------------------------------------------------------------
# Layouts: the tensors a group needs, before any memory is touched
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorLayout:
    """One tensor's shape, dtype and the axis a block id indexes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    block_dim: int

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def block_bytes(self) -> int:
        """Bytes one block id occupies in this tensor."""
        per_block_shape = self.shape[: self.block_dim] + self.shape[self.block_dim + 1 :]
        return math.prod(per_block_shape) * self.dtype.itemsize


def _spec_layouts(spec: KVCacheSpec, num_layers: int, num_blocks: int) -> list[_TensorLayout]:
    """The tensors ``num_layers`` layers of ``spec`` need for ``num_blocks`` blocks."""
    # MLA classes come first: MLAAttentionSpec and SlidingWindowMLASpec are AttentionSpecs too.
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        if spec.num_kv_heads != 1:
            raise ValueError(
                f"an MLA spec holds one latent per token, so num_kv_heads must be 1; got {spec.num_kv_heads}"
            )
        shape = (num_layers, num_blocks, spec.block_size, spec.head_size)
        return [_TensorLayout(shape, torch_dtype(spec.dtype), block_dim=1)]
    if isinstance(spec, AttentionSpec):
        # Encoder-only attention gets the attention layout too: the spec charges page_size_bytes for
        # it and the manager hands out its block ids, so the memory must exist (see KVCacheTensors).
        shape = (num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)  # type: ignore[assignment]  # the Mamba/attention shapes differ in rank; the tuple's length is the layout's
        return [_TensorLayout(shape, torch_dtype(spec.dtype), block_dim=2)]
    if isinstance(spec, MambaSpec):
        if len(spec.shapes) != len(spec.dtypes):
            raise ValueError(
                f"a MambaSpec needs one dtype per state shape; got {len(spec.shapes)} shapes "
                f"and {len(spec.dtypes)} dtypes"
            )
        return [
            _TensorLayout((num_layers, num_blocks, *state_shape), torch_dtype(dtype), block_dim=1)
            for state_shape, dtype in zip(spec.shapes, spec.dtypes)
        ]
    if isinstance(spec, UniformTypeKVCacheSpecs):
        # The inner specs are per layer (layer name -> spec): one layer each, never times num_layers.
        layouts: list[_TensorLayout] = []
        for inner in spec.kv_cache_specs.values():
            layouts.extend(_spec_layouts(inner, 1, num_blocks))
        return layouts
    raise ValueError(f"no tensor layout for KV cache spec {type(spec).__name__}")


def _group_layouts(group: KVCacheGroupSpec, num_blocks: int) -> list[_TensorLayout]:
    """The tensors ``group`` needs for ``num_blocks`` blocks; their bytes per block are checked."""
    layouts = _spec_layouts(group.kv_cache_spec, group.num_layers, num_blocks)
    layout_block_bytes = sum(layout.block_bytes() for layout in layouts)
    assert layout_block_bytes == group.block_bytes, (
        f"tensor layout of {type(group.kv_cache_spec).__name__} gives {layout_block_bytes} bytes per block, "
        f"the spec says {group.block_bytes}"
    )
    return layouts


# --------------------------------------------------------------------------------------------------
# The tensors
# --------------------------------------------------------------------------------------------------


class KVCacheTensors:
    """The KV cache tensors of every KV cache group, indexed by block id.

    Each group has its own tensors (groups share block *ids*, not memory), so one block id costs
    the sum of all groups' bytes per block. Per group ``g`` (``L`` = ``num_layers``, ``N`` =
    ``num_blocks``, ``B`` = ``block_size`` in tokens, ``H`` = ``num_kv_heads``, ``D`` =
    ``head_size``), :meth:`tensors` gives:

    - Attention kinds (full, sink full, sliding window, chunked local, cross, encoder-only): one
      tensor ``[L, 2, N, B, H, D]``; axis 1 is K (0) and V (1); the block axis is 2.
    - MLA kinds (``MLAAttentionSpec``, ``SlidingWindowMLASpec``): one tensor ``[L, N, B, D]``, one
      latent of ``D`` elements per token (``num_kv_heads`` must be 1); the block axis is 1.
    - Mamba: one tensor per state ``i``, ``[L, N, *shapes[i]]`` in ``dtypes[i]``; the block axis is 1
      (a block holds one request's whole recurrent state; ``block_size`` does not enter the shape).
    - ``UniformTypeKVCacheSpecs``: the inner specs are one per layer, so one tensor per inner spec
      (several for an inner Mamba spec), in the inner spec's layout above with ``L = 1``, in the
      inner mapping's order.

    Encoder-only attention keeps no KV across steps, so vLLM gives it no paged cache at all. Here
    it gets the full attention layout anyway: its spec charges ``page_size_bytes`` per block, the
    manager hands out block ids for it, and :func:`num_blocks_from_budget` counts those bytes, so
    allocating them keeps "bytes per block == the spec's bytes" true for every group. A zero-size
    tensor would be the leaner choice once the spec charges 0 bytes for encoder-only layers.

    Block ids from the manager index the ``N`` axis directly; block 0 is the null block.

    Args:
        config: the config the tensors were sized from.
        group_tensors: per group (outer index = ``group_idx``), that group's tensors in the layouts
            above. :func:`allocate_kv_cache_tensors` builds them; pass your own to wrap memory
            allocated elsewhere.

    Raises:
        ValueError: ``group_tensors`` does not match ``config`` (group count, shapes, dtypes) or
            its tensors are on more than one device.
    """

    def __init__(self, config: KVCacheConfig, group_tensors: Sequence[Sequence[torch.Tensor]]) -> None:
        if len(group_tensors) != len(config.kv_cache_groups):
            raise ValueError(
                f"group_tensors has {len(group_tensors)} groups; the config has {len(config.kv_cache_groups)}"
            )
        self._config = config
        self._layouts = [_group_layouts(group, config.num_blocks) for group in config.kv_cache_groups]
        self._tensors = tuple(tuple(tensors) for tensors in group_tensors)
        devices = {t.device for tensors in self._tensors for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"KV cache tensors must share one device; got {sorted(map(str, devices))}")
        for group_idx, (layouts, tensors) in enumerate(zip(self._layouts, self._tensors)):
            expected = [(layout.shape, layout.dtype) for layout in layouts]
            got = [(tuple(t.shape), t.dtype) for t in tensors]
            if expected != got:
                raise ValueError(f"group {group_idx}: expected tensors (shape, dtype) {expected}; got {got}")
        self._device = devices.pop() if devices else torch.device("cpu")

    @property
    def config(self) -> KVCacheConfig:
        """The config the tensors were sized from."""
        return self._config

    @property
    def num_groups(self) -> int:
        """KV cache groups (one tensor tuple each)."""
        return len(self._tensors)

    @property
    def num_blocks(self) -> int:
        """Blocks per group (the size of every tensor's block axis), block 0 included."""
        return self._config.num_blocks

    @property
    def device(self) -> torch.device:
        """The device every tensor lives on."""
        return self._device

    def _check_group_idx(self, group_idx: int) -> None:
        if not 0 <= group_idx < len(self._tensors):
            raise IndexError(f"group_idx must be in [0, {len(self._tensors)}); got {group_idx}")

    def tensors(self, group_idx: int) -> tuple[torch.Tensor, ...]:
        """Group ``group_idx``'s tensors, in the layouts of the class docstring.

        Raises:
            IndexError: no such group.
        """
        self._check_group_idx(group_idx)
        return self._tensors[group_idx]

    def block_dims(self, group_idx: int) -> tuple[int, ...]:
        """Per tensor of group ``group_idx``, the axis a block id indexes.

        Raises:
            IndexError: no such group.
        """
        self._check_group_idx(group_idx)
        return tuple(layout.block_dim for layout in self._layouts[group_idx])

    def bytes_per_block(self, group_idx: int | None = None) -> int:
        """Bytes one block id occupies.

        Args:
            group_idx: the group; None for the total over all groups (what a block id costs).

        Returns:
            Bytes per block; equals the spec's ``KVCacheGroupSpec.block_bytes`` (summed over groups
            for the total).

        Raises:
            IndexError: no such group.
        """
        if group_idx is None:
            return sum(self.bytes_per_block(g) for g in range(len(self._tensors)))
        self._check_group_idx(group_idx)
        return sum(layout.block_bytes() for layout in self._layouts[group_idx])

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors (``num_blocks * bytes_per_block()``); on ``meta``, the nominal size,
        none of it allocated."""
        return sum(layout.num_bytes for layouts in self._layouts for layout in layouts)

    def dtype(self, group_idx: int) -> torch.dtype | None:
        """The dtype of group ``group_idx``'s tensors; None when they differ (e.g. a Mamba group
        whose states have different dtypes; see :meth:`dtypes`).

        Raises:
            IndexError: no such group.
        """
        dtypes = set(self.dtypes(group_idx))
        return dtypes.pop() if len(dtypes) == 1 else None

    def dtypes(self, group_idx: int) -> tuple[torch.dtype, ...]:
        """The dtype of each of group ``group_idx``'s tensors.

        Raises:
            IndexError: no such group.
        """
        return tuple(t.dtype for t in self.tensors(group_idx))

    def block_view(self, group_idx: int, block_id: int) -> tuple[torch.Tensor, ...]:
        """Views of block ``block_id`` in each of group ``group_idx``'s tensors (for tests and
        debugging).

        The views share memory with the cache: writing them writes the block. Shapes are the
        tensors' without the block axis: ``[L, 2, B, H, D]`` (attention), ``[L, B, D]`` (MLA),
        ``[L, *shapes[i]]`` (Mamba state ``i``).

        Raises:
            IndexError: no such group, or ``block_id`` is not in ``[0, num_blocks)``.
        """
        tensors = self.tensors(group_idx)
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id must be in [0, {self.num_blocks}); got {block_id}")
        return tuple(t.select(layout.block_dim, block_id) for t, layout in zip(tensors, self._layouts[group_idx]))

    def describe(self) -> str:
        """A short human summary: the device and totals, then per group its kind, shapes, dtypes and
        bytes per block."""
        storage = " (meta: shapes only, nothing allocated)" if self._device.type == "meta" else ""
        lines = [
            f"KV cache on {self._device}{storage}: {self.num_blocks} blocks x "
            f"{_format_bytes(self.bytes_per_block())} = {_format_bytes(self.total_bytes)}"
        ]
        for group_idx, (group, tensors) in enumerate(zip(self._config.kv_cache_groups, self._tensors)):
            kind = get_kv_cache_spec_kind(group.kv_cache_spec).value
            shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)
            lines.append(
                f"  group {group_idx} {kind} ({group.num_layers} layers): {shapes or 'no tensors'}; "
                f"{_format_bytes(self.bytes_per_block(group_idx))}/block"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"KVCacheTensors(device={self._device}, num_groups={self.num_groups}, "
            f"num_blocks={self.num_blocks}, total_bytes={self.total_bytes})"
        )


# --------------------------------------------------------------------------------------------------
# Sizing and allocation
# --------------------------------------------------------------------------------------------------


def num_blocks_from_budget(groups: Sequence[KVCacheGroupSpec], budget_bytes: int) -> int:
    """How many block ids fit in ``budget_bytes``.

    Each block id costs the sum of all groups' bytes per block (each group has its own tensors),
    and block 0 (the null block) is one of them.

    Args:
        groups: the KV cache groups (``KVCacheConfig.kv_cache_groups``).
        budget_bytes: bytes the KV cache may occupy.

    Returns:
        ``budget_bytes // bytes per block id``, at least 2.

    Raises:
        ValueError: no groups, the groups occupy 0 bytes per block, or fewer than 2 blocks (the null
            block and one usable block) fit; the message names the budget, the bytes per block and
            the minimum budget.
    """
    if not groups:
        raise ValueError("groups must hold at least one KV cache group")
    block_bytes = sum(group.block_bytes for group in groups)
    if block_bytes <= 0:
        raise ValueError("the KV cache groups occupy 0 bytes per block; a budget cannot size them")
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"memory budget of {_format_bytes(budget_bytes)} holds {max(num_blocks, 0)} blocks of "
            f"{_format_bytes(block_bytes)} each (all groups); at least 2 blocks "
            f"({_format_bytes(2 * block_bytes)}) are needed, block 0 being the null block"
        )
    return num_blocks


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
        free_bytes, _total_bytes = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    if device.type == "cpu":
        return _available_cpu_memory_bytes()
    return None


def _is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is torch (or Python) failing to allocate memory."""
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):  # torch >= 2.5 aliases it as torch.OutOfMemoryError
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


def _allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, allocator: Allocator | None) -> torch.Tensor:
    """A zero-filled tensor of ``shape`` and ``dtype``: ``torch.zeros``, or raw bytes from
    ``allocator`` viewed as it and zero-filled."""
    if allocator is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    raw = allocator(num_bytes, device)
    assert raw.dtype == torch.uint8 and raw.numel() == num_bytes and raw.device == device, (
        f"the allocator gave {raw.numel()} {raw.dtype} on {raw.device}; asked {num_bytes} uint8 on {device}"
    )
    return raw.view(dtype).view(shape).zero_()


def allocate_kv_cache_tensors(
    config: KVCacheConfig, device: torch.device | str, *, allocator: Allocator | None = None
) -> KVCacheTensors:
    """Allocate the KV cache tensors of ``config`` on ``device``, zero-filled.

    The total (``config.num_blocks * bytes per block id``) is checked against the device's free
    memory before anything is allocated (CPU: psutil or /proc/meminfo ``MemAvailable``; CUDA:
    ``torch.cuda.mem_get_info``; ``meta``: always fits, since nothing is allocated). An allocator
    failure that still happens is re-raised as the same error.

    The tensors are created with ``torch.zeros``, not ``torch.empty`` (what vLLM uses): zeroing
    touches every page, so the memory is really committed (host RSS shows it) and an over-commit
    fails here, at start, rather than later under load or through the kernel's OOM killer. It
    costs one pass over the memory at start.

    Args:
        config: the block count and groups to size the tensors from.
        device: a torch device or a :func:`resolve_device` value (``"auto"``, ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``, ``"meta"``).
        allocator: where the raw bytes of each tensor come from (:data:`Allocator`; None:
            ``torch.zeros``). Not called on ``meta``.

    Returns:
        The tensors, laid out as :class:`KVCacheTensors` documents.

    Raises:
        KVCacheAllocationError: the tensors do not fit; the message gives the bytes asked and the
            bytes available.
        ValueError: a bad ``device`` value, or a spec with no tensor layout.
    """
    resolved = resolve_device(device) if isinstance(device, str) else device
    layouts = [_group_layouts(group, config.num_blocks) for group in config.kv_cache_groups]
    bytes_asked = sum(layout.num_bytes for group_layouts in layouts for layout in group_layouts)
    bytes_available = _available_memory_bytes(resolved)
    if bytes_available is not None and bytes_asked > bytes_available:
        raise KVCacheAllocationError(bytes_asked, bytes_available, resolved)
    try:
        group_tensors = [
            [
                _allocate_zeroed(layout.shape, layout.dtype, resolved, None if resolved.type == "meta" else allocator)
                for layout in group_layouts
            ]
            for group_layouts in layouts
        ]
    except Exception as exc:  # torch raises OutOfMemoryError on CUDA, RuntimeError on CPU
        if not _is_out_of_memory(exc):
            raise
        if resolved.type == "cuda":
            torch.cuda.empty_cache()  # hand back what the partial allocation cached
        raise KVCacheAllocationError(bytes_asked, _available_memory_bytes(resolved), resolved) from exc
    return KVCacheTensors(config, group_tensors)


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

