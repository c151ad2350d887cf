"""Snapshots of the cached set: a compact mirror fed by the event log, cut in parts, shared.

A snapshot is AllBlocksCleared, then BlockStored for every cached block (parents before children),
then the same blocks re-announced in the server's recency order (``reused``), all at a watermark
seq: a subscriber that applies it and then every batch from watermark + 1 holds exactly the
server's cached set and misses nothing.

Cost rules (issue 15):

* The mirror (:class:`CachedSetMirror`) keeps, per cached (group_idx, block hash), a reference to
  one record per stored run (the BlockStored's hashes, token ids and keys), not an object per
  block; a cut reads the records in segments, never a tuple per block. A record whose blocks are mostly gone is
  compacted to its live blocks, so one surviving block does not pin a whole prompt, and token ids
  beyond the newest ``UNPACKED_TOKENS`` are packed to 8 bytes each. It is fed by an event-log
  listener; its ``seq`` is the last batch applied.
* :meth:`SnapshotSource.get` is the one entry point (gRPC ``StreamEvents`` and ``TakeEvents``
  use it; so can any other wire). Every caller that asks for the same group filter at the same
  mirror seq shares one cut (:attr:`SnapshotSource.num_cuts` counts cuts, exported as
  ``kvservice_snapshot_cuts``). A cut copies nothing: while one is in production the source holds
  appended batches back from the mirror, so the cut reads the mirror's own table as it was at its
  watermark; its parts keep record segments (``(record, start, stop)``: a record is never
  changed in what a cut reads), so they stay exact after the mirror moves on. A record announced
  in one BlockStored and left alone is cut in C-level slices and comparisons, with no Python
  work per block (see :func:`snapshot_runs`); a part's events are made (one slice of tokens per
  segment) only when it is encoded. A cut is produced by a task in parts of about
  ``part_tokens`` token ids that yields to the loop every ``YIELD_EVERY_TOKENS`` tokens; callers
  read parts as they are produced. What a cut builds for the cycle collector to walk is a few
  small tuples per event (its segments refer to records); its dicts of hashes are untracked.
* The held batches are applied when the last cut in production ends (by a task that yields every
  ``YIELD_EVERY_TOKENS`` tokens of events); no new cut starts before that, so holding back is
  bounded by one production.
* At most ``max_concurrent_cuts`` cuts are produced at once; a caller joins the cut of its filter
  at the mirror's seq (in production, its watermark may be below the log's head while batches are
  held, which is still exact: the caller follows batches from that watermark + 1, which are
  retained; or done, when no batch is held), or waits for a slot or for the mirror to catch up.
* Every stream writes its parts within one shared :class:`ByteBudget` (``max_bytes_in_flight``,
  ``max_bytes_per_s``): however many streams read snapshots at once, at most that many bytes are
  being written, at most that rate on average, one write started per turn of the loop, so other
  calls get their turns and snapshot traffic takes a bounded share of the machine.
* :meth:`SnapshotSource.min_bytes` is a lower bound on a snapshot's encoded size known before any
  cut (one byte per token id, twice: both halves carry every block), so an answer
  with a byte limit (TakeEvents) is refused at once when the bound is above it.

Nothing here knows protobuf: parts are lists of events; the servicer edge encodes them (once per
payload format, memoized on the :class:`Snapshot`, so a burst of subscribers shares the bytes too).

The package is cut by job (docs/ARCHITECTURE.md §4), arrows pointing down only
(``tests/unit/test_import_graph.py``); everything outside it imports from the package itself:

* :mod:`~kvservice.server.snapshot.source`: :class:`SnapshotSource`, the one entry point (the
  mirror fed by the log, shared cuts, holding batches back, the shared budget);
* :mod:`~kvservice.server.snapshot.cut`: :func:`snapshot_runs` (which events, in which order, as
  record segments), :func:`materialize` (a run's event), :class:`Snapshot` (one cut's parts);
* :mod:`~kvservice.server.snapshot.mirror`: :class:`CachedSetMirror`, its records and its table;
* :mod:`~kvservice.server.snapshot.budget`: what snapshot work may take from the other calls
  (:data:`YIELD_EVERY_TOKENS`, :class:`HalfShare`, :class:`ByteBudget`).
"""

from kvservice.server.snapshot.budget import (
    DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT,
    DEFAULT_SNAPSHOT_BYTES_PER_S,
    YIELD_EVERY_TOKENS,
    ByteBudget,
    HalfShare,
)
from kvservice.server.snapshot.cut import Snapshot, materialize, run_tokens, snapshot_events, snapshot_runs
from kvservice.server.snapshot.mirror import CachedSetMirror, MirroredBlock
from kvservice.server.snapshot.source import SnapshotSource

__all__ = [
    "DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT",
    "DEFAULT_SNAPSHOT_BYTES_PER_S",
    "YIELD_EVERY_TOKENS",
    "ByteBudget",
    "CachedSetMirror",
    "HalfShare",
    "MirroredBlock",
    "Snapshot",
    "SnapshotSource",
    "materialize",
    "run_tokens",
    "snapshot_events",
    "snapshot_runs",
]
