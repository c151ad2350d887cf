"""Types of the compiled block-hash chain (``_hashchain.c``; see its header for the rule)."""

from collections.abc import Sequence
from typing import Any

def extend(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    start: int,
    end: int,
    block_size: int,
    parent: bytes,
    layout: int,
    /,
) -> None:
    """Append the chained SHA-256 hashes of blocks ``start..end-1`` (in blocks, of ``block_size``
    tokens each) to ``block_hashes``; ``layout`` 0 is canonical CBOR, 1 is pickle protocol 5.

    Raises:
        ValueError: a token id outside the encoder's range, a parent that is not 32 bytes, or a
            block too large to encode; nothing is appended.
    """

def chain_packed(data: bytes | bytearray | memoryview, block_size: int, parent: bytes, layout: int, /) -> list[bytes]:
    """The chained SHA-256 hashes of every full block (``len(data) // 4 // block_size`` blocks) of
    little-endian int32 token ids, from ``parent`` (the root hash), as a new list; the GIL is
    released while hashing 64 blocks or more.

    Raises:
        ValueError: a negative token id, a length that is not a multiple of 4, a parent that is
            not 32 bytes, or a block too large to encode.
    """

class PackedChains:
    """Many packed prompts' chains: :meth:`run` hashes them in order in the thread that calls it
    (the GIL released throughout); :meth:`hashes` takes one prompt's as soon as it is done."""

    def __init__(self, prompts: list[Any], block_size: int, parent: bytes, layout: int, /) -> None:
        """``prompts``: objects with the buffer protocol (bytes, a C-contiguous int32 array), each
        little-endian int32 token ids.

        Raises:
            ValueError: a parent that is not 32 bytes or a block too large to encode.
            TypeError: a prompt without the buffer protocol.
            BufferError: a prompt that is not C-contiguous (ValueError from a numpy array).
        """
    def run(self) -> None:
        """Hash every prompt in order (once).

        Raises:
            RuntimeError: run() was called already.
        """
    def hashes(self, i: int, /) -> list[bytes] | None:
        """Prompt ``i``'s block hashes once :meth:`run` has hashed it (waiting until then: hand
        ``run`` to a thread first); None for a negative token id or a length that is not a
        multiple of 4."""
