"""The import graph of ``kvservice`` and ``kvservice_client``: no cycle, and the layers' arrows go
one way (docs/ARCHITECTURE.md §1).

The graph is read from the source with :mod:`ast` (nothing is imported): every ``import`` and
``from ... import`` counts, at module level, inside functions (lazy imports) and under
``if TYPE_CHECKING:`` (a type-only cycle still ties two modules together). ``from a.b import c``
is an edge to ``a.b.c`` when that is a module, else to ``a.b``; the parent packages' ``__init__``
files are not edges (importing ``a.b.c`` runs them, but a re-exporting ``__init__`` is not a cycle).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"kvservice": ROOT / "kvservice", "kvservice_client": ROOT / "clients/python/kvservice_client"}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    names: tuple[str, ...]
    """The names taken by ``from imported import names`` (empty for ``import imported``)."""
    line: int


def _module_name(path: Path, package: str, package_dir: Path) -> str:
    parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, package_dir in PACKAGE_DIRS.items():
        for path in sorted(package_dir.rglob("*.py")):
            found[_module_name(path, package, package_dir)] = path
    return found


MODULES = _modules()
# C extensions (``kvservice_client/_hashchain.c``): leaves that import nothing of ours.
EXTENSIONS = {
    _module_name(path, package, package_dir)
    for package, package_dir in PACKAGE_DIRS.items()
    for path in package_dir.rglob("*.c")
}


def _resolve(module: str, level: int, importer: str, is_package: bool) -> str:
    if level == 0:
        return module
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _imports(importer: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, importer, is_package)
            plain = []
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    yield Import(importer, submodule, (), node.lineno)
                else:
                    plain.append(alias.name)
            if plain:
                yield Import(importer, base, tuple(plain), node.lineno)


def _internal(module: str) -> str | None:
    """The module of the two packages that ``import module`` loads (None: a third-party one)."""
    while module:
        if module in MODULES or module in EXTENSIONS:
            return module
        module = module.rpartition(".")[0]
    return None


IMPORTS = [imp for name, path in MODULES.items() for imp in _imports(name, path)]
EDGES: dict[str, set[str]] = {name: set() for name in [*MODULES, *EXTENSIONS]}
for _imp in IMPORTS:
    _target = _internal(_imp.imported)
    if _target is not None and _target != _imp.importer:
        EDGES[_imp.importer].add(_target)


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_walk_sees_the_known_edges():
    """The graph is not vacuous: edges every reader of the code knows are there."""
    assert "kvservice.core.kv_cache_manager" in EDGES["kvservice.server.app"]
    assert "kvservice_client.events" in EDGES["kvservice.core.block_pool"]
    assert "kvservice.server.app" in EDGES["kvservice.cli"]  # a lazy import inside a function
    assert len(MODULES) > 40


def test_cycle_finder_finds_a_cycle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert _strongly_connected(EDGES) == []


def _imports_of(prefix: str) -> list[Import]:
    return [imp for imp in IMPORTS if imp.importer == prefix or imp.importer.startswith(prefix + ".")]


def _where(imp: Import) -> str:
    return f"{MODULES[imp.importer].relative_to(ROOT)}:{imp.line} imports {imp.imported} {list(imp.names)}"


def _is_under(module: str | None, package: str) -> bool:
    return module is not None and (module == package or module.startswith(package + "."))


def test_client_imports_nothing_of_the_server_package():
    """kvservice_client is installable alone: it never imports kvservice."""
    bad = [_where(i) for i in _imports_of("kvservice_client") if _is_under(_internal(i.imported), "kvservice")]
    assert bad == []


@pytest.mark.parametrize(
    "layer", ["kvservice.server", "kvservice.replay", "kvservice.memory", "kvservice.cli", "kvservice.watch"]
)
def test_core_imports_no_outer_layer(layer: str):
    """server -> core -> kvservice_client: the core never imports a layer above it."""
    bad = [_where(i) for i in _imports_of("kvservice.core") if _is_under(_internal(i.imported), layer)]
    assert bad == []


@pytest.mark.parametrize(
    "third_party", ["grpc", "torch", "google.protobuf", "kvservice_client._proto", "kvservice_client.client"]
)
def test_core_is_pure_python(third_party: str):
    """The core has no gRPC, no protobuf, no torch (docs/ARCHITECTURE.md §1)."""
    bad = [_where(i) for i in _imports_of("kvservice.core") if _is_under(i.imported, third_party)]
    assert bad == []


def test_only_the_cli_and_the_replay_import_the_server():
    importers = {
        i.importer
        for i in IMPORTS
        if _is_under(_internal(i.imported), "kvservice.server") and not _is_under(i.importer, "kvservice.server")
    }
    assert {m for m in importers if not (m == "kvservice.cli" or _is_under(m, "kvservice.replay"))} == set()


def test_the_replay_uses_only_the_public_start_function():
    """The replay talks to the service over gRPC (the client); of the server it only starts one."""
    taken = sorted(
        {
            (i.imported, i.names)
            for i in _imports_of("kvservice.replay")
            if _is_under(_internal(i.imported), "kvservice.server")
        }
    )
    assert taken in ([], [("kvservice.server.app", ("start_server",))])


_RUNNING_SERVER_PARTS = {
    "engine",
    "event_log",
    "servicer",
    "tensors",
    "reaper",
    "closers",
    "zmq_publisher",
    "nats_sink",
    "health",
}


def test_the_replay_reaches_no_part_of_a_running_server():
    """Of the server ``start_server`` returns, the replay uses the public surface (address,
    check_invariants, cached_hashes, stop), never its parts."""
    bad = []
    for name, path in MODULES.items():
        if not _is_under(name, "kvservice.replay"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in _RUNNING_SERVER_PARTS:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert bad == []


_REPLAY_REPORTS = ("kvservice.replay.report", "kvservice.replay.multi_report")


@pytest.mark.parametrize("report", _REPLAY_REPORTS)
def test_a_replay_report_imports_no_run_router_client_or_server(report: str):
    """A replay's report is plain figures (docs/ARCHITECTURE.md §1): it imports only the other
    report modules of the replay, and nothing of the client or the server."""
    bad = [
        _where(i)
        for i in _imports_of(report)
        if (target := _internal(i.imported)) is not None and target not in _REPLAY_REPORTS
    ]
    assert bad == []


def test_the_router_imports_neither_the_run_nor_its_report():
    """``replay.routing`` (feed seam, Instance, Router) sits below the run that drives it."""
    bad = [
        _where(i)
        for i in _imports_of("kvservice.replay.routing")
        if _internal(i.imported) in ("kvservice.replay.multi", "kvservice.replay.multi_report")
    ]
    assert bad == []


_SNAPSHOT = "kvservice.server.snapshot"
_SNAPSHOT_ARROWS = {
    # each module of the snapshot package: the package's modules it may import (docs/ARCHITECTURE.md §4)
    f"{_SNAPSHOT}.budget": set(),
    f"{_SNAPSHOT}.mirror": set(),
    f"{_SNAPSHOT}.cut": {f"{_SNAPSHOT}.budget", f"{_SNAPSHOT}.mirror"},
    f"{_SNAPSHOT}.source": {f"{_SNAPSHOT}.budget", f"{_SNAPSHOT}.cut", f"{_SNAPSHOT}.mirror"},
}


def test_the_snapshot_package_is_cut_by_job_with_its_arrows_down():
    """mirror and budget import nothing of the package, the cut reads the mirror (and the budget's
    step), the source uses all three; the package's ``__init__`` only re-exports."""
    assert {m for m in MODULES if _is_under(m, _SNAPSHOT)} == {_SNAPSHOT, *_SNAPSHOT_ARROWS}
    for module, allowed in _SNAPSHOT_ARROWS.items():
        inside = {t for t in EDGES[module] if _is_under(t, _SNAPSHOT)}
        assert inside == allowed, module


def test_outside_the_snapshot_package_only_the_package_is_imported():
    """Its modules are its own business: everything else imports from ``kvservice.server.snapshot``."""
    bad = [
        _where(i)
        for i in IMPORTS
        if not _is_under(i.importer, _SNAPSHOT)
        and _is_under(_internal(i.imported), _SNAPSHOT)
        and _internal(i.imported) != _SNAPSHOT
    ]
    assert bad == []


def test_the_server_reads_snapshots_through_the_source_alone():
    """No server module outside the snapshot package reads a source's mirror or its held batches
    (``.mirror``, ``.pending``): every snapshot (gRPC and ZMQ) comes from ``SnapshotSource.get``."""
    bad = []
    for name, path in MODULES.items():
        if not _is_under(name, "kvservice.server") or _is_under(name, _SNAPSHOT):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("mirror", "pending"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert bad == []
