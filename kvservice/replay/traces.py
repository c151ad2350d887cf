"""Request traces for ``kvservice replay``: records, readers, token expansion and ideal hit rates.

Three trace formats are read, each by a generator that yields :class:`TraceRequest` records in
file order (nothing is sorted, nothing is read ahead):

* **Mooncake** JSONL (:func:`read_mooncake`): ``timestamp`` (ms), ``input_length``,
  ``output_length`` and ``hash_ids`` (one id per 512-token block). The trace has no tokens, so each
  hash id is expanded into 512 deterministic token ids (:func:`block_token_ids`); equal ids give
  equal tokens, so the trace's sharing structure reaches the service unchanged.
* **Azure** LLM inference CSV (:func:`read_azure_csv`): lengths and arrival times only. Every
  request gets its own random tokens, so the expected prefix-cache hit rate is about 0 (a
  no-sharing control).
* **Token JSONL** (:func:`read_token_jsonl`): real token ids, one request per line.

:func:`read_trace` picks the reader from the file. Malformed input raises
:class:`TraceFormatError` (a ``ValueError``) naming the file, the line and the field, when the
generator reaches that line.

Token ids are generated with SHAKE-128 keyed by the file namespace and the hash id (or request),
never with Python's salted ``hash()`` or a NumPy ``Generator`` (whose streams NumPy does not promise
to keep across releases), so the same trace gives the same tokens in every process, on every
machine and with every NumPy version. Generated ids lie in cl100k_base's ordinary range 0..100255.

This module imports neither gRPC nor torch.
"""

from __future__ import annotations

import calendar
import csv
import functools
import hashlib
import json
import math
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = [
    "DEFAULT_TRACE",
    "MAX_TOKEN_ID",
    "TRACE_BLOCK_SIZE",
    "TraceFormat",
    "TraceFormatError",
    "TraceRequest",
    "VOCAB_SIZE",
    "block_token_ids",
    "derive_session_id",
    "detect_trace_format",
    "expand_hash_ids",
    "ideal_prefix_hits",
    "ideal_prefix_hits_from_hash_ids",
    "output_token_ids",
    "read_azure_csv",
    "read_mooncake",
    "read_token_jsonl",
    "read_trace",
]

TRACE_BLOCK_SIZE = 512
"""Tokens per Mooncake trace block (one hash id)."""

VOCAB_SIZE = 100256
"""Generated token ids lie in ``0 .. VOCAB_SIZE - 1``: cl100k_base's ordinary tokens (its special
tokens start at 100257)."""

MAX_TOKEN_ID = 2**31 - 1
"""The largest token id a trace may carry (token ids are stored as signed 32-bit ints)."""

TraceFormat = Literal["mooncake", "azure", "tokens"]

DEFAULT_TRACE: Path = Path(str(resources.files("kvservice.replay") / "data" / "mooncake_conversation_sample.jsonl"))
"""The embedded default trace: the first 991 lines of Mooncake's conversation trace (see
``kvservice/replay/data/README.md``). A real file path (the package is installed from a directory,
not a zip)."""

_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

# Domain-separation prefixes for the SHAKE-128 keys: bumping a version changes every token.
_BLOCK_KEY = b"kvservice/trace-block/v1\x00"
_OUTPUT_KEY = b"kvservice/trace-output/v1\x00"
_AZURE_KEY = b"kvservice/trace-azure/v1\x00"

assert array("i").itemsize == 4, "token ids are stored as 4-byte C ints"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``prompt_token_ids`` is an ``array('i')`` (signed 32-bit C ints), not a list: a list costs a
    pointer plus an int object per token (about 36 bytes a token for ids above 256), the array 4
    bytes a token, and a replay of the 991-line default trace holds 13.6 million prompt tokens. It
    is a ``Sequence[int]``, slices to arrays, and feeds ``hashing.BlockHasher`` and protobuf
    ``repeated`` fields unchanged. The record is frozen but an array is mutable: treat it as
    read-only.

    Attributes:
        request_id: unique within the trace (Mooncake and Azure: ``"<namespace>:<index>"``, index
            0-based in file order).
        arrival_ms: arrival time in milliseconds since the trace start.
        prompt_token_ids: the prompt, in tokens.
        output_length: tokens to generate (the decode phase grows the request by this many).
        session_id: the request's conversation, or None (Azure; token JSONL without one). For
            Mooncake a *derived label*, see :func:`derive_session_id`.
        hash_ids: Mooncake's 512-token block ids of the prompt; empty for the other formats.
    """

    request_id: str
    arrival_ms: float
    prompt_token_ids: array
    output_length: int
    session_id: str | None = None
    hash_ids: tuple[int, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt length in tokens."""
        return len(self.prompt_token_ids)


class TraceFormatError(ValueError):
    """Malformed trace input.

    Attributes:
        path: the trace file.
        line: the 1-based line number of the offending line.
        field: the offending field (a JSON key or CSV column), or None when the whole line is bad.
    """

    def __init__(self, path: str | Path, line: int, field: str | None, problem: str) -> None:
        where = f"{path}, line {line}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")
        self.path = str(path)
        self.line = line
        self.field = field


# --------------------------------------------------------------------------------------------
# Token generation


def _shake_token_bytes(key: bytes, num_tokens: int) -> bytes:
    """``num_tokens`` token ids in ``0 .. VOCAB_SIZE - 1`` as native int32 bytes, from SHAKE-128.

    Each id is a little-endian 32-bit word of the XOF output modulo ``VOCAB_SIZE`` (the modulo bias,
    under 3e-5 relative, does not matter for a replay).
    """
    words = np.frombuffer(hashlib.shake_128(key).digest(4 * num_tokens), dtype="<u4")
    return (words % VOCAB_SIZE).astype(np.int32).tobytes()


@functools.lru_cache(maxsize=16384)
def _block_bytes(namespace: str, hash_id: int) -> bytes:
    """One trace block's 512 token ids as native int32 bytes (2 KiB; the cache holds 32 MiB)."""
    key = _BLOCK_KEY + namespace.encode() + b"\x00" + str(hash_id).encode()
    return _shake_token_bytes(key, TRACE_BLOCK_SIZE)


def block_token_ids(namespace: str, hash_id: int) -> array:
    """The 512 token ids that trace block ``hash_id`` of ``namespace`` expands to.

    Deterministic in (namespace, hash_id) across calls, processes and machines; different ids (or
    namespaces) give different blocks with overwhelming probability. Ids lie in 0..100255.

    Args:
        namespace: the trace's id space (by default the trace file's name stem).
        hash_id: the Mooncake block id.

    Returns:
        A new ``array('i')`` of ``TRACE_BLOCK_SIZE`` token ids.
    """
    tokens = array("i")
    tokens.frombytes(_block_bytes(namespace, hash_id))
    return tokens


def expand_hash_ids(hash_ids: Sequence[int], input_length: int, *, namespace: str) -> array:
    """A Mooncake prompt: the blocks of ``hash_ids`` concatenated, cut to ``input_length`` tokens.

    Args:
        hash_ids: the prompt's trace block ids, in order.
        input_length: the prompt length in tokens (at most ``512 * len(hash_ids)``).
        namespace: the trace's id space.

    Returns:
        ``array('i')`` of ``input_length`` token ids.

    Raises:
        ValueError: ``input_length`` is negative or longer than the blocks.
    """
    if not 0 <= input_length <= TRACE_BLOCK_SIZE * len(hash_ids):
        raise ValueError(f"input_length {input_length} does not fit {len(hash_ids)} blocks of {TRACE_BLOCK_SIZE}")
    tokens = array("i")
    tokens.frombytes(b"".join([_block_bytes(namespace, h) for h in hash_ids]))
    del tokens[input_length:]
    return tokens


def output_token_ids(request_id: str, n: int) -> array:
    """``n`` deterministic output token ids for request ``request_id`` (ids in 0..100255).

    A function of the request id only, so distinct requests get distinct outputs (with overwhelming
    probability) and a replay's decode tokens never match another request's prompt blocks, as the
    trace intends (its later turns are described by their own hash ids).

    Args:
        request_id: the request's id (unique within a trace).
        n: the number of output tokens (>= 0).

    Returns:
        ``array('i')`` of ``n`` token ids; the first ``k`` are the same for every ``n >= k``.

    Raises:
        ValueError: ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    tokens = array("i")
    tokens.frombytes(_shake_token_bytes(_OUTPUT_KEY + request_id.encode(), n))
    return tokens


# --------------------------------------------------------------------------------------------
# Sessions


def derive_session_id(hash_ids: Sequence[int], *, namespace: str | None = None) -> str | None:
    """A Mooncake request's session: the id of its second trace block (its first if it has one).

    Mooncake traces name no sessions; they show conversations only through shared prefixes. Ids are
    prefix-consistent (an id always follows the same ids), so ``hash_ids[1]`` names the request's
    first 1,024 tokens, and the rule reads: *two requests are in one session when they share their
    first two 512-token blocks*. Block 0 alone is not enough: in the conversation trace every
    request starts with id 0, a system prompt shared by all of them. A later turn of a
    conversation resends the earlier turns, so it keeps their leading ids and extends them.

    Figures for the rule (arrival order; a *pair* is two consecutive requests of one session, and
    it *extends* when the later prompt holds all of the earlier prompt's blocks but perhaps its
    last, partial one, i.e. the earlier turn plus its answer plus a new question):

    ============================== ========== ========= ========== ================ ==========
    file                            requests   sessions  multi-turn  requests in them  max turns
    ============================== ========== ========= ========== ================ ==========
    conversation head (9,626 lines)      9,626     5,963      1,826   5,489 (57 %)           35
    default sample (991 lines)             991       775        157     373 (38 %)             7
    synthetic head (3,194 lines)         3,194     2,162        371   1,403 (44 %)           12
    ============================== ========== ========= ========== ================ ==========

    In the conversation head, 3,096 of 3,663 pairs (84.5 %) extend (the rest share 2 or more
    blocks and then branch: an edited or regenerated turn), and in 1,499 of the 1,826 multi-turn
    sessions every later turn extends some earlier one; the longest session is 35 turns whose
    prompts grow from 13 to 19 blocks. The sample: 184 of 216 pairs extend. In the synthetic
    trace (no shared system prompt) the rule splits 11 conversations that share only their first
    block.

    It is a *derived label*, and two limits come from the trace's 512-token granularity: a turn
    whose shared part is shorter than two full blocks shares no id beyond block 0 with its
    conversation (the conversation head's 1,059 two-block requests all form their own sessions),
    and two conversations that start with the same 1,024 tokens (a longer common system prompt)
    merge. The label never enters a hash or a hit (events only carry it).

    Args:
        hash_ids: the request's trace block ids.
        namespace: prefixed to the label (``"<namespace>:<id>"``) so files do not collide.

    Returns:
        The session label, or None when ``hash_ids`` is empty.
    """
    if not hash_ids:
        return None
    key = hash_ids[1] if len(hash_ids) >= 2 else hash_ids[0]
    return f"{namespace}:{key}" if namespace is not None else str(key)


# --------------------------------------------------------------------------------------------
# Readers


def _check_limit(limit: int | None) -> None:
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0; got {limit!r}")


def _iter_json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields (1-based line number, object) for each non-blank line of a JSONL file."""
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(path, lineno, None, f"invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(path, lineno, None, f"expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _get_int(
    obj: dict[str, Any], field: str, path: Path, lineno: int, *, minimum: int, default: int | None = None
) -> int:
    if field not in obj:
        if default is not None:
            return default
        raise TraceFormatError(path, lineno, field, "missing")
    value = obj[field]
    if type(value) is not int:
        raise TraceFormatError(path, lineno, field, f"must be an integer, got {value!r}")
    if value < minimum:
        raise TraceFormatError(path, lineno, field, f"must be >= {minimum}, got {value}")
    return value


def _get_ms(obj: dict[str, Any], field: str, path: Path, lineno: int, *, default: float | None = None) -> float:
    if field not in obj:
        if default is not None:
            return default
        raise TraceFormatError(path, lineno, field, "missing")
    value = obj[field]
    if type(value) not in (int, float) or not math.isfinite(value):
        raise TraceFormatError(path, lineno, field, f"must be a number (ms), got {value!r}")
    if value < 0:
        raise TraceFormatError(path, lineno, field, f"must be >= 0, got {value}")
    return float(value)


def _get_str(obj: dict[str, Any], field: str, path: Path, lineno: int) -> str | None:
    value = obj.get(field)
    if value is not None and type(value) is not str:
        raise TraceFormatError(path, lineno, field, f"must be a string or null, got {value!r}")
    return value


def read_mooncake(
    path: str | Path, *, namespace: str | None = None, limit: int | None = None
) -> Iterator[TraceRequest]:
    """Reads a Mooncake trace (JSONL: ``timestamp``, ``input_length``, ``output_length``,
    ``hash_ids``).

    The prompt is ``hash_ids`` expanded block by block (:func:`block_token_ids`) and cut to
    ``input_length`` tokens; ``session_id`` is :func:`derive_session_id`; ``request_id`` is
    ``"<namespace>:<index>"``. Other keys on a line are ignored; blank lines are skipped.

    Args:
        path: the JSONL file.
        namespace: the hash-id space; defaults to the file's name stem, so two trace files never
            share blocks by accident. Give two files the same namespace only if their ids agree.
        limit: yield at most this many requests (None: all).

    Yields:
        One :class:`TraceRequest` per line, in file order.

    Raises:
        TraceFormatError: a line is not a JSON object, a field is missing or has the wrong type, a
            length is negative, ``input_length`` is 0, or ``len(hash_ids) !=
            ceil(input_length / 512)``.
        ValueError: ``limit`` is negative.
    """
    path = Path(path)
    _check_limit(limit)
    ns = path.stem if namespace is None else namespace
    if limit == 0:
        return
    index = 0
    for lineno, obj in _iter_json_objects(path):
        arrival_ms = _get_ms(obj, "timestamp", path, lineno)
        input_length = _get_int(obj, "input_length", path, lineno, minimum=1)
        output_length = _get_int(obj, "output_length", path, lineno, minimum=0)
        if "hash_ids" not in obj:
            raise TraceFormatError(path, lineno, "hash_ids", "missing")
        hash_ids = obj["hash_ids"]
        if type(hash_ids) is not list or not all(type(h) is int and h >= 0 for h in hash_ids):
            raise TraceFormatError(path, lineno, "hash_ids", "must be a list of integers >= 0")
        num_blocks = -(-input_length // TRACE_BLOCK_SIZE)
        if len(hash_ids) != num_blocks:
            raise TraceFormatError(
                path,
                lineno,
                "hash_ids",
                f"has {len(hash_ids)} ids; input_length {input_length} needs "
                f"ceil({input_length}/{TRACE_BLOCK_SIZE}) = {num_blocks}",
            )
        yield TraceRequest(
            request_id=f"{ns}:{index}",
            arrival_ms=arrival_ms,
            prompt_token_ids=expand_hash_ids(hash_ids, input_length, namespace=ns),
            output_length=output_length,
            session_id=derive_session_id(hash_ids, namespace=ns),
            hash_ids=tuple(hash_ids),
        )
        index += 1
        if limit is not None and index >= limit:
            return


def _parse_azure_timestamp(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` (no zone) -> integer 100 ns ticks, exact."""
    whole, _, frac = text.strip().partition(".")
    if not frac.isdigit() and frac != "":
        raise ValueError(f"bad fractional seconds {frac!r}")
    seconds = calendar.timegm(time.strptime(whole, "%Y-%m-%d %H:%M:%S"))
    return seconds * 10**7 + int((frac + "0000000")[:7])


def read_azure_csv(
    path: str | Path, *, namespace: str | None = None, limit: int | None = None
) -> Iterator[TraceRequest]:
    """Reads an Azure LLM inference trace (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``).

    ``arrival_ms`` is the time since the first row's ``TIMESTAMP`` (wall-clock strings such as
    ``2023-11-16 18:15:46.6805900``, 7 fractional digits, no zone; computed exactly in 100 ns
    ticks). The trace has no prefix information, so every request gets its own random prompt
    tokens (a no-sharing control: the expected prefix-cache hit rate is about 0). No sessions.

    Args:
        path: the CSV file (header line required).
        namespace: keys the generated tokens; defaults to the file's name stem.
        limit: yield at most this many requests (None: all).

    Yields:
        One :class:`TraceRequest` per data row; ``request_id`` is ``"<namespace>:<index>"``.

    Raises:
        TraceFormatError: wrong header, wrong column count, an unparsable timestamp, a timestamp
            before the first row's, ``ContextTokens < 1`` or ``GeneratedTokens < 0``.
        ValueError: ``limit`` is negative.
    """
    path = Path(path)
    _check_limit(limit)
    ns = path.stem if namespace is None else namespace
    if limit == 0:
        return
    with path.open("r", encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != _AZURE_HEADER:
            raise TraceFormatError(path, 1, None, f"expected the header {','.join(_AZURE_HEADER)}, got {header!r}")
        first_ticks: int | None = None
        index = 0
        for row in reader:
            lineno = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 3:
                raise TraceFormatError(path, lineno, None, f"expected 3 columns, got {len(row)}")
            try:
                ticks = _parse_azure_timestamp(row[0])
            except ValueError as e:
                raise TraceFormatError(path, lineno, "TIMESTAMP", f"{row[0]!r}: {e}") from None
            if first_ticks is None:
                first_ticks = ticks
            elif ticks < first_ticks:
                raise TraceFormatError(path, lineno, "TIMESTAMP", "earlier than the first row")
            lengths = []
            for field, text, minimum in (
                ("ContextTokens", row[1], 1),
                ("GeneratedTokens", row[2], 0),
            ):
                try:
                    value = int(text)
                except ValueError:
                    raise TraceFormatError(path, lineno, field, f"must be an integer, got {text!r}") from None
                if value < minimum:
                    raise TraceFormatError(path, lineno, field, f"must be >= {minimum}, got {value}")
                lengths.append(value)
            request_id = f"{ns}:{index}"
            prompt = array("i")
            prompt.frombytes(_shake_token_bytes(_AZURE_KEY + request_id.encode(), lengths[0]))
            yield TraceRequest(
                request_id=request_id,
                arrival_ms=(ticks - first_ticks) / 10**4,
                prompt_token_ids=prompt,
                output_length=lengths[1],
            )
            index += 1
            if limit is not None and index >= limit:
                return


def read_token_jsonl(
    path: str | Path, *, namespace: str | None = None, limit: int | None = None
) -> Iterator[TraceRequest]:
    """Reads a plain token trace: JSONL, one request object per line.

    Fields:

    * ``token_ids`` (required): the prompt, a non-empty list of ints in ``0 .. 2**31 - 1``.
    * ``timestamp`` (ms, >= 0): default the request's 0-based index in the file (1 ms apart).
    * ``output_length`` (tokens, >= 0): default **1**. Every real request generates at least the
      token its prefill samples (vLLM rejects ``max_tokens < 1``), and one decode token keeps the
      allocate-grow-free path of a replay exercised without changing which prompt blocks are
      shared.
    * ``session_id`` (string or null): default None.
    * ``request_id`` (string): default ``"<namespace>:<index>"``. Must be unique in the file.

    Other keys are ignored; blank lines are skipped.

    Args:
        path: the JSONL file.
        namespace: prefix of the default request ids; defaults to the file's name stem.
        limit: yield at most this many requests (None: all).

    Yields:
        One :class:`TraceRequest` per line, in file order (``hash_ids`` empty).

    Raises:
        TraceFormatError: a line is not a JSON object; ``token_ids`` is missing, empty, not a list
            of ints or has an id out of range; another field has the wrong type or is negative; a
            ``request_id`` repeats.
        ValueError: ``limit`` is negative.
    """
    path = Path(path)
    _check_limit(limit)
    ns = path.stem if namespace is None else namespace
    if limit == 0:
        return
    seen_ids: set[str] = set()
    index = 0
    for lineno, obj in _iter_json_objects(path):
        if "token_ids" not in obj:
            raise TraceFormatError(path, lineno, "token_ids", "missing")
        token_list = obj["token_ids"]
        if type(token_list) is not list or not token_list:
            raise TraceFormatError(path, lineno, "token_ids", "must be a non-empty list of ints")
        for i, t in enumerate(token_list):
            if type(t) is not int:
                raise TraceFormatError(path, lineno, "token_ids", f"token_ids[{i}] = {t!r} is not an integer")
            if not 0 <= t <= MAX_TOKEN_ID:
                raise TraceFormatError(
                    path,
                    lineno,
                    "token_ids",
                    f"token_ids[{i}] = {t} is out of range 0..{MAX_TOKEN_ID}",
                )
        arrival_ms = _get_ms(obj, "timestamp", path, lineno, default=float(index))
        output_length = _get_int(obj, "output_length", path, lineno, minimum=0, default=1)
        session_id = _get_str(obj, "session_id", path, lineno)
        request_id = _get_str(obj, "request_id", path, lineno)
        if request_id is None:
            request_id = f"{ns}:{index}"
        if request_id in seen_ids:
            raise TraceFormatError(path, lineno, "request_id", f"{request_id!r} repeats")
        seen_ids.add(request_id)
        yield TraceRequest(
            request_id=request_id,
            arrival_ms=arrival_ms,
            prompt_token_ids=array("i", token_list),
            output_length=output_length,
            session_id=session_id,
        )
        index += 1
        if limit is not None and index >= limit:
            return


def detect_trace_format(path: str | Path) -> TraceFormat:
    """Tells a trace file's format from its extension and first non-blank line.

    ``.csv`` or a first line starting ``TIMESTAMP,`` -> ``"azure"``; otherwise the first line must
    be a JSON object: with ``hash_ids`` -> ``"mooncake"``, with ``token_ids`` -> ``"tokens"``.

    Raises:
        TraceFormatError: the file is empty or its first line fits no format.
    """
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return "azure"
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if line.lstrip("\ufeff").startswith("TIMESTAMP,"):
                return "azure"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(
                    path, lineno, None, f"not a CSV header nor JSON ({e.msg}); unknown format"
                ) from None
            if isinstance(obj, dict) and "hash_ids" in obj:
                return "mooncake"
            if isinstance(obj, dict) and "token_ids" in obj:
                return "tokens"
            raise TraceFormatError(
                path,
                lineno,
                None,
                "unknown format: expected a 'hash_ids' (Mooncake) or 'token_ids' (token JSONL) "
                "field, or an Azure CSV header",
            )
    raise TraceFormatError(path, 1, None, "empty trace file")


def read_trace(
    path: str | Path,
    *,
    format: TraceFormat | Literal["auto"] = "auto",  # noqa: A002 - the CLI option's name
    namespace: str | None = None,
    limit: int | None = None,
) -> Iterator[TraceRequest]:
    """Reads any supported trace, choosing the reader by ``format`` or from the file.

    Args:
        path: the trace file.
        format: ``"mooncake"``, ``"azure"``, ``"tokens"`` or ``"auto"``
            (:func:`detect_trace_format`).
        namespace: passed to the reader (default: the file's name stem).
        limit: yield at most this many requests (None: all).

    Returns:
        The reader's generator.

    Raises:
        TraceFormatError: the format cannot be told (raised at once), or a malformed line (raised
            when iteration reaches it).
        ValueError: an unknown ``format`` or a negative ``limit``.
    """
    if format == "auto":
        format = detect_trace_format(path)
    if format == "mooncake":
        return read_mooncake(path, namespace=namespace, limit=limit)
    if format == "azure":
        return read_azure_csv(path, namespace=namespace, limit=limit)
    if format == "tokens":
        return read_token_jsonl(path, namespace=namespace, limit=limit)
    raise ValueError(f"unknown trace format {format!r}; expected auto, mooncake, azure or tokens")


# --------------------------------------------------------------------------------------------
# Ideal hit rates


def ideal_prefix_hits(requests: Iterable[TraceRequest | Sequence[int]], block_size: int) -> list[int]:
    """Per request, the prefix-cache hit in tokens of a cache with infinite capacity.

    Replays the prompts in order through a never-evicting prefix cache of ``block_size``-token
    blocks, keyed like the service's chained block hashes (a block matches only under the same
    parent chain): a request's hit is its longest leading run of full blocks that some earlier
    prompt also had as full blocks, capped so the last token is always computed, i.e. at most
    ``((len(prompt) - 1) // block_size) * block_size``. Every full block of every prompt enters the
    cache; output tokens are not simulated (a replay's decode tokens never match a later prompt).
    This is an upper bound for any replay of the same requests at this block size.

    Args:
        requests: :class:`TraceRequest` records or plain prompt token sequences, in arrival order.
        block_size: the service's block size in tokens (>= 1).

    Returns:
        One hit per request, in tokens (a multiple of ``block_size``).

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1; got {block_size}")
    block_bytes = 4 * block_size
    seen: set[bytes] = set()
    hits: list[int] = []
    for request in requests:
        ids = request.prompt_token_ids if isinstance(request, TraceRequest) else request
        tokens = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
        view = memoryview(tokens).cast("B")
        max_hit_blocks = max(len(tokens) - 1, 0) // block_size
        parent = b""
        hit_blocks = 0
        matching = True
        for i in range(len(tokens) // block_size):
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(view[i * block_bytes : (i + 1) * block_bytes])
            parent = digest.digest()
            if matching:
                if parent in seen:
                    hit_blocks += 1
                    continue
                matching = False
            seen.add(parent)
        hits.append(min(hit_blocks, max_hit_blocks) * block_size)
    return hits


def ideal_prefix_hits_from_hash_ids(
    requests: Iterable[TraceRequest | Sequence[int]],
) -> list[int]:
    """Per request, the ideal prefix hit in Mooncake trace blocks, by the data README's rule.

    A request's hit is the length of its longest leading run of hash ids seen in any earlier
    request (an infinite cache that never evicts, at the trace's 512-token granularity). As in the
    README, the hit is *not* capped for the last token: a prompt whose every id was seen before
    hits all its blocks. For the service's rule at 512 tokens, cap it at
    ``(input_length - 1) // 512``. In tokens it is ``min(hit * 512, input_length)``.

    Args:
        requests: :class:`TraceRequest` records (their ``hash_ids``) or plain hash-id sequences, in
            arrival order.

    Returns:
        One hit per request, in trace blocks.
    """
    seen: set[int] = set()
    hits: list[int] = []
    for request in requests:
        hash_ids = request.hash_ids if isinstance(request, TraceRequest) else request
        hit = 0
        for h in hash_ids:
            if h not in seen:
                break
            hit += 1
        seen.update(hash_ids)
        hits.append(hit)
    return hits
