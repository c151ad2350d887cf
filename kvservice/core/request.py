"""Per-request state the cache manager reads: tokens, block hashes, progress, and reporting options."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from kvservice_client.hashing import BlockHasher, LoRA, MultiModalFeature

__all__ = ["KVCacheReportMode", "Request"]


class KVCacheReportMode(str, enum.Enum):
    """How a request's prefix-cache reuse is reported on the event stream.

    * ``incremental`` (default): only blocks that become newly cached are reported.
    * ``full``: blocks the request reuses from the prefix cache are reported too, once per
      admission, as BlockStored marked ``reused`` (docs/ARCHITECTURE.md §3.5).
    """

    INCREMENTAL = "incremental"
    FULL = "full"

    @classmethod
    def parse(cls, value: str | KVCacheReportMode) -> KVCacheReportMode:
        """Parse a mode name.

        Raises:
            ValueError: ``value`` is not "incremental" or "full" (the message names the value).
        """
        if type(value) is cls:  # already a mode (the engine's calls): Enum's lookup is the slow path
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"kv_cache_report_mode must be 'incremental' or 'full'; got {value!r}") from None


class Request:
    """A request as the cache manager sees it.

    Block hashes are computed at the manager's hash block size as soon as the request is created
    and extended as output tokens are appended (only full blocks are hashed).

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, in tokens.
        block_hasher: the manager's hasher (``KVCacheManager.block_hasher``); None = no hashes
            (prefix caching off).
        lora: the LoRA adapter, or None.
        cache_salt: isolates this request's prefix cache (hashed into block 0), or None.
        mm_features: multimodal placeholders in the prompt.
        session_id: echoed on the BlockStored events this request triggers; never hashed, never
            used for hits, eviction or scheduling.
        kv_cache_report_mode: "incremental" (default) or "full".
        block_hashes: the prompt's block hashes, already computed by ``block_hasher`` over these
            ids (one per full block at its block size; e.g. ``BlockHasher.hash_packed`` of the
            bytes the ids came from), taken instead of hashing again; None: hashed here.

    Raises:
        ValueError: unknown ``kv_cache_report_mode`` (the message names the value).

    Attributes:
        all_token_ids: prompt then appended outputs, in tokens.
        block_hashes: hash of every full block of ``all_token_ids`` at the hash block size.
        num_computed_tokens: tokens whose KV is computed (or scheduled); advanced by the caller
            after each successful allocation, as vLLM's scheduler does.
        num_in_flight_tokens: of ``num_computed_tokens``, tokens scheduled but not yet processed
            (vLLM 0.33's async scheduling); a group frees skipped positions only below
            ``num_computed_tokens - num_in_flight_tokens``. 0 unless a scheduler says so.
        allocation_id: the admission it runs under (set by the engine each time it is admitted:
            >= 1, unique within the server's life; 0 while it has not been). Writes of its blocks
            name it, so a stream for an earlier admission of the same request id is told apart.
    """

    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_prompt_tokens",
        "block_hashes",
        "num_computed_tokens",
        "lora",
        "cache_salt",
        "mm_features",
        "session_id",
        "kv_cache_report_mode",
        "num_in_flight_tokens",
        "allocation_id",
        "_block_hasher",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        *,
        block_hasher: BlockHasher | None,
        lora: LoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        session_id: str | None = None,
        kv_cache_report_mode: str | KVCacheReportMode = KVCacheReportMode.INCREMENTAL,
        block_hashes: list[bytes] | None = None,
    ) -> None:
        self.kv_cache_report_mode = KVCacheReportMode.parse(kv_cache_report_mode)
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.lora = lora
        self.cache_salt = cache_salt
        self.mm_features = tuple(mm_features)
        self.session_id = session_id
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.allocation_id = 0
        self._block_hasher = block_hasher
        if block_hashes is not None and block_hasher is not None:
            if len(block_hashes) != self.num_prompt_tokens // block_hasher.block_size:
                raise ValueError(
                    f"{len(block_hashes)} block hashes for a prompt of {self.num_prompt_tokens} tokens in blocks of "
                    f"{block_hasher.block_size}"
                )
            self.block_hashes = block_hashes
        else:
            self.block_hashes = []
            self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        """Tokens so far (prompt + outputs)."""
        return len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids."""
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def report_reuse(self) -> bool:
        """Whether prefix-cache reuse is reported (full mode)."""
        return self.kv_cache_report_mode is KVCacheReportMode.FULL

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated tokens and hash any block they complete."""
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        hasher = self._block_hasher
        # Only a completed block adds a hash (most decode steps complete none).
        if hasher is not None and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self._update_block_hashes()

    def replace_tail(
        self, num_tokens_kept: int, token_ids: Sequence[int], num_hashes_kept: int, block_hashes: Sequence[bytes]
    ) -> None:
        """Set the tokens and hashes of a request whose scheduler owns them (vLLM's: it hashes its
        requests itself): keep the first ``num_tokens_kept`` tokens and ``num_hashes_kept`` hashes,
        then append ``token_ids`` and ``block_hashes``. The caller has checked the bounds (the
        prompt is never cut, hashes cover only full blocks of the tokens); no hash is computed here.

        Raises:
            ValueError: the request hashes its own tokens (made with a ``block_hasher``).
        """
        if self._block_hasher is not None:
            raise ValueError(f"request {self.request_id!r} hashes its own tokens; its hashes cannot be set")
        del self.all_token_ids[num_tokens_kept:]
        self.all_token_ids.extend(token_ids)
        del self.block_hashes[num_hashes_kept:]
        self.block_hashes.extend(block_hashes)

    def truncate_tokens(self, num_tokens: int) -> None:
        """Drop tokens beyond the first ``num_tokens`` (and the hashes of blocks they completed).

        Used to undo an append when the call that carried it changes nothing. Never cuts into the
        prompt or into computed tokens.

        Raises:
            ValueError: ``num_tokens`` is below the prompt length or the computed tokens.
        """
        if num_tokens < max(self.num_prompt_tokens, self.num_computed_tokens):
            raise ValueError(f"cannot truncate to {num_tokens} tokens: prompt or computed tokens would be lost")
        del self.all_token_ids[num_tokens:]
        if self._block_hasher is not None:
            del self.block_hashes[num_tokens // self._block_hasher.block_size :]

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self._block_hasher.extend(
                self.block_hashes,
                self.all_token_ids,
                lora=self.lora,
                cache_salt=self.cache_salt,
                mm_features=self.mm_features,
            )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
