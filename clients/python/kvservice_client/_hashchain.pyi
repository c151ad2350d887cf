"""Types of the compiled block-hash chain (``_hashchain.c``; see its header for the rule)."""

from collections.abc import Sequence

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
