"""The block-hash rule shared by the server and every watcher.

A *block* is ``block_size`` consecutive tokens of a request. Only full blocks are hashed. Block
``i``'s hash chains its parent's hash (block ``i - 1``; the *root hash* for block 0), its token ids
and its *extra keys*::

    root        = H(seed)
    hash[i]     = H((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra_keys[i]))

``extra_keys[i]`` is ``None`` when block ``i`` has none, else a tuple of tagged tuples in the order
LoRA, multimodal, cache salt (vLLM's order):

* ``("lora", lora_name, lora_path)`` on every block of a LoRA request;
* ``("mm", identifier, offset_in_block)`` for every multimodal input whose placeholder overlaps the
  block, ``offset_in_block`` its first placeholder token relative to the block's first token
  (negative when the input began in an earlier block), as vLLM 0.33's
  ``_gen_mm_extra_hash_keys``;
* ``("cache_salt", salt)`` on block 0 only (a non-empty salt, as vLLM).

``H`` is one of (:data:`HASH_ALGORITHMS`):

* ``sha256_cbor`` (default): SHA-256 of canonical CBOR (RFC 8949 section 4.2.1), reproducible in
  any language. With the default seed the hashes equal those of a vLLM engine using
  ``--prefix-caching-hash-algo sha256_cbor`` (checked against vectors measured from vLLM 0.33), so
  one KV-aware router can index kvservice and vLLM engines together.
* ``sha256``: SHA-256 of the pickled tuple (vLLM's ``sha256``; Python-only).
* ``xxhash``: 128-bit XXH3 of the pickled tuple (vLLM's ``xxhash``; Python-only).
* ``xxhash_cbor``: 128-bit XXH3 of canonical CBOR (vLLM's ``xxhash_cbor``).

The xxhash pair is fast and not collision resistant: vLLM derives their root from a random seed
unless ``PYTHONHASHSEED`` is set, so to share hashes with vLLM engines on xxhash give kvservice the
fleet's ``PYTHONHASHSEED`` as its seed. Every algorithm, with extra keys (LoRA, salt, multimodal),
is checked against vectors measured from vLLM 0.33 (``tests/data/vectors/vllm_0_33_block_hashes.json``).

The seed comes from configuration only; unlike vLLM we never read ``PYTHONHASHSEED``. Python's
salted builtin ``hash()`` is never used, so the same tokens give the same hashes in every process.

Events publish a hash as an unsigned 64-bit int by default (:func:`block_hash_to_int`: the digest's
last 8 bytes, big-endian, as vLLM does) or as the raw digest bytes.

This module imports neither torch nor gRPC.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import cbor2
import numpy as np
import xxhash

__all__ = [
    "BlockHash",
    "BlockHasher",
    "DEFAULT_HASH_ALGORITHM",
    "DEFAULT_HASH_SEED",
    "HASH_ALGORITHMS",
    "HashAlgorithm",
    "LoRA",
    "MultiModalFeature",
    "block_event_extra_keys",
    "block_hash_to_int",
    "get_hash_fn",
    "resolve_block_hashes",
]

BlockHash = bytes
"""A block hash: the raw digest (32 bytes for sha256*, 16 bytes for xxhash*). A hash resolved for a
group whose block size is ``k`` times the hash block size is ``k`` digests concatenated."""

HashAlgorithm = Literal["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"]
HASH_ALGORITHMS: tuple[str, ...] = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor")
DEFAULT_HASH_ALGORITHM: HashAlgorithm = "sha256_cbor"
DEFAULT_HASH_SEED = "vllm-none-hash"
"""vLLM's root seed for ``sha256_cbor``: ``root = sha256(canonical_cbor("vllm-none-hash"))``."""


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _xxhash_pickle(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256_cbor": _sha256_cbor,
    "sha256": _sha256_pickle,
    "xxhash": _xxhash_pickle,
    "xxhash_cbor": _xxhash_cbor,
}


def get_hash_fn(algorithm: str) -> Callable[[Any], bytes]:
    """Return the function mapping a Python value (tuple, bytes, int, str, None) to its digest.

    Raises:
        ValueError: ``algorithm`` is not one of :data:`HASH_ALGORITHMS` (the message names it).
    """
    try:
        return _HASH_FNS[algorithm]
    except KeyError:
        raise ValueError(f"hash_algorithm must be one of {', '.join(HASH_ALGORITHMS)}; got {algorithm!r}") from None


def block_hash_to_int(block_hash: bytes) -> int:
    """The event form of a hash: its last 8 bytes read as a big-endian unsigned 64-bit int."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class LoRA:
    """A LoRA adapter a request runs with.

    Attributes:
        lora_id: the adapter's integer id (published on events as ``lora_id``; not hashed).
        lora_name: the adapter's name (hashed, and published as ``lora_name``).
        lora_path: where the adapter was loaded from (hashed; may be None).
    """

    lora_id: int
    lora_name: str
    lora_path: str | None = None


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """A multimodal input's placeholder in the prompt.

    Attributes:
        identifier: the input's content hash (any string that identifies the content).
        offset: index of its first placeholder token, in tokens.
        length: number of placeholder tokens.
    """

    identifier: str
    offset: int
    length: int


class BlockHasher:
    """Computes chained block hashes for one (block_size, algorithm, seed).

    Args:
        block_size: tokens per hashed block (>= 1).
        algorithm: one of :data:`HASH_ALGORITHMS`.
        seed: the root seed; ``root_hash = H(seed)``.

    Raises:
        ValueError: unknown ``algorithm`` or ``block_size < 1``.
    """

    __slots__ = ("block_size", "algorithm", "seed", "hash_fn", "root_hash")

    def __init__(
        self,
        block_size: int,
        algorithm: str = DEFAULT_HASH_ALGORITHM,
        seed: str = DEFAULT_HASH_SEED,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        self.block_size = block_size
        self.algorithm = algorithm
        self.seed = seed
        self.hash_fn = get_hash_fn(algorithm)
        self.root_hash: bytes = self.hash_fn(seed)

    def hash_block(self, parent_block_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
        """Hash one full block; ``parent_block_hash`` None means block 0 (chains the root hash)."""
        parent = self.root_hash if parent_block_hash is None else parent_block_hash
        return self.hash_fn((parent, tuple(token_ids), extra_keys))

    def extend(
        self,
        block_hashes: list[bytes],
        token_ids: Sequence[int],
        *,
        lora: LoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> int:
        """Append the hashes of the full blocks of ``token_ids`` not yet in ``block_hashes``.

        ``block_hashes`` holds the hashes of the first ``len(block_hashes)`` blocks of
        ``token_ids`` (all the request's tokens so far, prompt then outputs) and is extended in
        place, so hashes grow incrementally as tokens are appended.

        Returns:
            The number of hashes appended (blocks).
        """
        block_size = self.block_size
        start = len(block_hashes)
        end = len(token_ids) // block_size
        if end <= start:
            return 0
        hash_fn = self.hash_fn
        parent = block_hashes[-1] if start else self.root_hash
        lora_key = ("lora", lora.lora_name, lora.lora_path) if lora is not None else None
        simple = lora_key is None and not mm_features and (not cache_salt or start > 0)
        if simple and _hashchain is not None and self.algorithm in _COMPILED_LAYOUTS:
            try:
                _hashchain.extend(
                    block_hashes, token_ids, start, end, block_size, parent, _COMPILED_LAYOUTS[self.algorithm]
                )
                return end - start
            except (ValueError, TypeError):  # ids or a shape it does not cover: the rule below does
                pass
        if simple and self.algorithm in _CBOR_DIGESTS:
            extend_cbor = _extend_cbor_vectorized if end - start >= _VECTORIZED_MIN_BLOCKS else _extend_cbor_cached
            try:
                extend_cbor(block_hashes, token_ids, start, end, block_size, parent, _CBOR_DIGESTS[self.algorithm])
                return end - start
            except ValueError:  # an id outside 0..2^32-1: the generic encoder handles any int
                del block_hashes[start:]
        for i in range(start, end):
            lo = i * block_size
            block_tokens = tuple(token_ids[lo : lo + block_size])
            if simple:
                extra_keys = None
            else:
                extra_keys = _block_extra_keys(i, lo, block_size, lora_key, cache_salt, mm_features)
            parent = hash_fn((parent, block_tokens, extra_keys))
            block_hashes.append(parent)
        return end - start

    def hash_prompt(
        self,
        token_ids: Sequence[int],
        *,
        lora: LoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> list[bytes]:
        """Hashes of every full block of ``token_ids`` (``len(token_ids) // block_size`` of them).

        ``token_ids`` may be ``bytes``/``bytearray``/``memoryview``: then it is read as the server
        reads ``packed_prompt_token_ids`` (little-endian int32), so a router hashes the very bytes
        it sent.

        Raises:
            ValueError: bytes whose length is not a multiple of 4.
        """
        if isinstance(token_ids, (bytes, bytearray, memoryview)):
            if lora is None and not cache_salt and not mm_features:
                hashes = self.hash_packed(token_ids)
                if hashes is not None:
                    return hashes
            token_ids = unpack_token_ids(token_ids)
        block_hashes: list[bytes] = []
        self.extend(block_hashes, token_ids, lora=lora, cache_salt=cache_salt, mm_features=mm_features)
        return block_hashes

    def hash_packed(self, data: bytes | bytearray | memoryview) -> list[bytes] | None:
        """Hashes of every full block of a packed prompt (little-endian int32 token ids, 4 bytes a
        token) with no extra keys (no LoRA, cache salt or multimodal features), computed by the
        compiled chain from the bytes themselves (with the GIL released from 64 blocks on). None
        where the compiled chain does not cover this algorithm or is not built, or for a negative
        token id, a length that is not a multiple of 4 or a buffer that is not contiguous: then hash
        through :meth:`extend`, which gives the rule's answer or its error."""
        layout = _COMPILED_LAYOUTS.get(self.algorithm)
        # None too for a build older than it (then the .pyi's signature is not there to trust)
        chain_packed: Callable[[Any, int, bytes, int], list[bytes]] | None = getattr(_hashchain, "chain_packed", None)
        if layout is None or chain_packed is None:
            return None
        try:
            return chain_packed(data, self.block_size, self.root_hash, layout)
        except (ValueError, BufferError):  # BufferError: a non-contiguous buffer (read in place only)
            return None

    def packed_chains(self, prompts: list[Any]) -> Any:
        """The chains of many packed prompts (each as :meth:`hash_packed` takes it, or a C-contiguous
        little-endian int32 array), to hash in another thread beside this one: a ``_hashchain.PackedChains`` whose ``run()`` (hand it to
        a thread first) hashes them in order with the GIL released, and whose ``hashes(i)`` waits
        for prompt ``i`` and returns :meth:`hash_packed`'s answer for it. None where the compiled
        chain does not cover this algorithm or is not built."""
        layout = _COMPILED_LAYOUTS.get(self.algorithm)
        chains = getattr(_hashchain, "PackedChains", None)  # None too for a build older than it
        if layout is None or chains is None:
            return None
        return chains(prompts, self.block_size, self.root_hash, layout)


def unpack_token_ids(data: bytes | bytearray | memoryview) -> array:
    """Little-endian int32 bytes (``packed_prompt_token_ids``) as an ``array('i')`` of token ids.

    Raises:
        ValueError: a length that is not a multiple of 4.
    """
    raw = bytes(data)
    if len(raw) % 4:
        raise ValueError(f"token ids: {len(raw)} bytes, not a multiple of 4 (little-endian int32 token ids)")
    ids = array("i", raw)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


try:  # the compiled chain (setup.py builds it when a compiler and OpenSSL's headers are there)
    import kvservice_client._hashchain as _hashchain  # typed by _hashchain.pyi beside the .c
except ImportError:  # no compiler at install time: the pure-Python rule is used throughout
    _hashchain = None  # type: ignore[assignment]  # mypy types an imported name as its module, never None; None stands for "not built", every use checks it first

_COMPILED_LAYOUTS: dict[str, int] = {"sha256_cbor": 0}
if pickle.HIGHEST_PROTOCOL == 5:  # the compiled pickle layout is protocol 5's
    _COMPILED_LAYOUTS["sha256"] = 1
"""Algorithms the compiled chain covers, blocks without extra keys only: ``_hashchain.extend``
encodes ``(parent, tuple(block_tokens), None)`` as canonical CBOR (0) or as pickle protocol 5 (1),
byte-identical to ``cbor2.dumps(..., canonical=True)`` / ``pickle.dumps(..., protocol=5)``, and
hashes with OpenSSL's SHA-256; it raises ValueError (appending nothing) for a token id or parent it
does not cover, and the pure-Python rule below, the reference, takes over."""


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_CBOR_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256_cbor": _sha256_digest,
    "xxhash_cbor": xxhash.xxh3_128_digest,
}
_VECTORIZED_MIN_BLOCKS = 24  # below this the generic path is faster (numpy has a fixed cost)


def _cbor_head(major: int, value: int) -> bytes:
    """A canonical CBOR head (RFC 8949 section 3: the shortest argument encoding).

    Raises:
        ValueError: ``value`` outside 0..2^64-1.
    """
    if value < 0:
        raise ValueError(f"{value} is negative")
    if value < 24:
        return bytes([major << 5 | value])
    for code, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | code]) + value.to_bytes(size, "big")
    raise ValueError(f"{value} does not fit a CBOR head")


def _encode_token_ids_cbor(token_ids: Sequence[int]) -> tuple[bytes, np.ndarray]:
    """Canonical CBOR of each token id (non-negative ints, major type 0) laid end to end.

    Returns:
        (the encodings concatenated, offsets: token ``i`` occupies ``[offsets[i], offsets[i+1])``).

    Raises:
        ValueError: a token id outside 0..2^32-1 (the vectorized path's range).
    """
    t = np.asarray(token_ids, dtype=np.int64)
    if t.size and (t.min() < 0 or t.max() >= 1 << 32):
        raise ValueError("token ids outside 0..2^32-1 take the generic path")
    t = t.astype(np.uint32)
    lengths = np.where(t < 24, 1, np.where(t < 256, 2, np.where(t < 65536, 3, 5)))
    offsets = np.zeros(len(t) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # Every token as a 5-byte record (head, then up to 4 argument bytes), then keep its first
    # ``length`` bytes: one vectorized pass instead of a scatter per size class.
    be = t.astype(">u4").view(np.uint8).reshape(-1, 4)
    one, two, three = lengths == 1, lengths == 2, lengths == 3
    records = np.empty((len(t), 5), dtype=np.uint8)
    records[:, 0] = np.where(one, t & 0xFF, np.where(two, 0x18, np.where(three, 0x19, 0x1A)))
    records[:, 1] = np.where(two, be[:, 3], np.where(three, be[:, 2], be[:, 0]))
    records[:, 2] = np.where(three, be[:, 3], be[:, 1])
    records[:, 3] = be[:, 2]
    records[:, 4] = be[:, 3]
    keep = np.arange(5) < lengths[:, None]
    return records[keep].tobytes(), offsets


def _extend_cbor_vectorized(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    start: int,
    end: int,
    block_size: int,
    parent: bytes,
    digest: Callable[[bytes], bytes],
) -> None:
    """``hash[i] = H(canonical_cbor((parent, tuple(block_tokens), None)))`` for blocks start..end-1,
    encoding every token once (the result is byte-identical to ``cbor2.dumps(..., canonical=True)``;
    a test checks it)."""
    encoded, offsets = _encode_token_ids_cbor(token_ids[start * block_size : end * block_size])
    array_head = _cbor_head(4, block_size)
    parent_head = _cbor_head(2, len(parent))
    prefix = b"\x83" + parent_head
    join = b"".join
    tail = array_head
    bounds = offsets[::block_size].tolist()
    for j in range(end - start):
        parent = digest(join((prefix, parent, tail, encoded[bounds[j] : bounds[j + 1]], b"\xf6")))
        block_hashes.append(parent)


_TOKEN_CBOR_CACHE_SIZE = 1 << 17  # covers the vocabularies of today's tokenizers (cl100k, Llama 3)
_token_cbor: list[bytes] = []


def _token_cbor_table() -> list[bytes]:
    """Canonical CBOR of every id below ``_TOKEN_CBOR_CACHE_SIZE`` (built on first use, ~5 MB)."""
    if not _token_cbor:
        _token_cbor.extend(_cbor_head(0, v) for v in range(_TOKEN_CBOR_CACHE_SIZE))
    return _token_cbor


def _extend_cbor_cached(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    start: int,
    end: int,
    block_size: int,
    parent: bytes,
    digest: Callable[[bytes], bytes],
) -> None:
    """As :func:`_extend_cbor_vectorized`, for a few blocks: token encodings come from a table."""
    table = _token_cbor_table()
    limit = _TOKEN_CBOR_CACHE_SIZE
    prefix = b"\x83" + _cbor_head(2, len(parent))
    array_head = _cbor_head(4, block_size)
    join = b"".join
    for i in range(start, end):
        lo = i * block_size
        body = join([table[t] if 0 <= t < limit else _cbor_head(0, t) for t in token_ids[lo : lo + block_size]])
        parent = digest(join((prefix, parent, array_head, body, b"\xf6")))
        block_hashes.append(parent)


def _block_extra_keys(
    block_idx: int,
    start_token: int,
    block_size: int,
    lora_key: tuple | None,
    cache_salt: str | None,
    mm_features: Sequence[MultiModalFeature],
) -> tuple | None:
    keys: list[tuple] = []
    if lora_key is not None:
        keys.append(lora_key)
    end_token = start_token + block_size
    for feature in mm_features:
        if feature.offset < end_token and feature.offset + feature.length > start_token:
            keys.append(("mm", feature.identifier, feature.offset - start_token))
    if cache_salt and block_idx == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def block_event_extra_keys(
    block_idx: int,
    block_size: int,
    *,
    lora: LoRA | None,
    cache_salt: str | None,
    mm_features: Sequence[MultiModalFeature] = (),
) -> list | None:
    """The ``extra_keys`` entry vLLM publishes for block ``block_idx`` (untagged), or None.

    Bare LoRA name, ``[identifier, offset_in_block]`` per overlapping multimodal input (the offset
    relative to the block's first token, as in the hash key), bare salt on block 0 (vLLM 0.33's
    ``to_event_extra_keys``).
    """
    keys: list = []
    if lora is not None:
        keys.append(lora.lora_name)
    start_token = block_idx * block_size
    end_token = start_token + block_size
    for feature in mm_features:
        if feature.offset < end_token and feature.offset + feature.length > start_token:
            keys.append([feature.identifier, feature.offset - start_token])
    if cache_salt and block_idx == 0:
        keys.append(cache_salt)
    return keys or None


class _MergedBlockHashes(Sequence[bytes]):
    """A lazy view of hashes at ``scale`` times the hash block size (``scale`` digests joined)."""

    __slots__ = ("_hashes", "_scale")

    def __init__(self, hashes: Sequence[bytes], scale: int) -> None:
        self._hashes = hashes
        self._scale = scale

    def __len__(self) -> int:
        return len(self._hashes) // self._scale

    @overload
    def __getitem__(self, idx: int) -> bytes: ...
    @overload
    def __getitem__(self, idx: slice) -> list[bytes]: ...
    def __getitem__(self, idx: int | slice) -> bytes | list[bytes]:
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(idx)
        scale = self._scale
        return b"".join(self._hashes[idx * scale : (idx + 1) * scale])


def resolve_block_hashes(block_hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> Sequence[bytes]:
    """View hashes computed at ``hash_block_size`` tokens as hashes of ``block_size``-token blocks.

    A group whose block size is ``k * hash_block_size`` sees block ``j``'s hash as the
    concatenation of hashes ``j*k .. j*k+k-1`` (as vLLM's ``BlockHashListWithBlockSize`` does). The
    view is lazy and follows ``block_hashes`` as it grows.

    Raises:
        ValueError: ``block_size`` is not a positive multiple of ``hash_block_size``.
    """
    if block_size == hash_block_size:
        return block_hashes
    if hash_block_size < 1 or block_size < hash_block_size or block_size % hash_block_size:
        raise ValueError(f"block_size {block_size} must be a multiple of the hash block size {hash_block_size}")
    return _MergedBlockHashes(block_hashes, block_size // hash_block_size)
