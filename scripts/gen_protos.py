#!/usr/bin/env python3
"""Regenerate the committed kvservice.v1 stubs from ``protos/`` with pinned tools.

Usage::

    python scripts/gen_protos.py           # rewrite clients/python/kvservice_client/_proto/
    python scripts/gen_protos.py --check   # regenerate into a temp dir; exit 1 if the tree is stale

Output (``clients/python/kvservice_client/_proto/``)::

    __init__.py
    kvservice/__init__.py
    kvservice/v1/__init__.py                   re-exports messages, enums (and their values), stub,
                                               servicer (sorted __all__)
    kvservice/v1/kv_cache_service_pb2.py       protoc --python_out
    kvservice/v1/kv_cache_service_pb2.pyi      mypy-protobuf --mypy_out
    kvservice/v1/kv_cache_service_pb2_grpc.py  grpcio-tools --grpc_python_out
    kvservice/v1/kv_cache_service_pb2_grpc.pyi mypy-protobuf --mypy_grpc_out
    kvservice/v1/kv_cache_service_rpcs.py      this script (:func:`rpcs_module`): the clients' default
                                               method of each RPC, typed, documented by the RPC's
                                               comment in the proto
    kvservice/v1/kv_cache_service.proto        a copy of the source (shipped in the client wheel)

How imports come out right without rewriting them: protoc names a generated module after the
.proto's path below its include root, and the Python path of the stubs is
``kvservice_client._proto.kvservice.v1`` (top-level ``kvservice`` is the server package, so the
stubs cannot live at ``kvservice.v1``). So the script stages ``protos/<path>.proto`` at
``<tmp>/kvservice_client/_proto/<path>.proto`` and runs protoc with ``<tmp>`` as the only include
root: the generated ``from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2`` lines
are protoc's own. The price is the descriptor's file name,
``kvservice_client/_proto/kvservice/v1/kv_cache_service.proto`` (seen in server reflection and in the
protobuf version-check message). It breaks nothing that resolves by symbol (reflection, grpcurl,
Any type URLs, the wire format); a .proto under ``protos/`` that imports a sibling by its
``kvservice/...`` path could not be resolved this way, so the script refuses such an import with an
explanation instead of generating something wrong.

The tools are pinned (:data:`PINNED_VERSIONS`): the generated files record the grpcio and protobuf
versions they need at runtime (``GRPC_GENERATED_VERSION``, ``ValidateProtobufRuntimeVersion``),
so the generator sets the client's dependency floors. It is an old one on purpose: grpcio-tools
1.66.2 (protobuf 5.27 gencode) lets the client run with grpcio >= 1.66.2 and protobuf >= 5.27.2,
beside packages that pin protobuf 5 or 6, where stubs from the newest tools would demand the
newest grpcio and protobuf. Those tools need protobuf < 6, which the dev venv's grpcio and
OpenTelemetry packages do not allow, so they live in a venv of their own, ``.venv-protogen/``
(made on first use, with exactly the pins; gitignored). Output is byte-for-byte deterministic
(sorted inputs, relative paths, no timestamps).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
CLIENT_ROOT = REPO_ROOT / "clients" / "python"
PROTO_PACKAGE = "kvservice_client._proto"
"""Python package the proto tree is mirrored under (``protos/kvservice/v1`` -> ``<this>.kvservice.v1``)."""
OUTPUT_DIR = CLIENT_ROOT / Path(*PROTO_PACKAGE.split("."))

PINNED_VERSIONS: dict[str, str] = {"grpcio-tools": "1.66.2", "mypy-protobuf": "5.1.0"}
"""Distribution name -> the exact version the committed stubs were generated with."""

TOOLS_VENV = REPO_ROOT / ".venv-protogen"
"""The venv holding exactly :data:`PINNED_VERSIONS` (made by :func:`tools_python` when missing)."""

SCRIPT_NAME = "scripts/gen_protos.py"
_ALLOWED_IMPORT_PREFIXES = ("google/protobuf/",)
_GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


class GenerationError(RuntimeError):
    """Generation cannot proceed (wrong tool versions, a protoc failure, an unsupported import)."""


def _installed_versions(python: str) -> dict[str, str | None]:
    """The versions of the pinned distributions in ``python``'s environment (None: absent)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for d in sys.argv[1:]:\n"
        "    try: out[d] = m.version(d)\n"
        "    except m.PackageNotFoundError: out[d] = None\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run([python, "-c", code, *PINNED_VERSIONS], capture_output=True, text=True, check=True)
    versions: dict[str, str | None] = json.loads(result.stdout)
    return versions


def tools_python() -> str:
    """An interpreter that has exactly the pinned tools: :data:`TOOLS_VENV`'s, made (``python -m
    venv`` and ``pip install`` of the pins, from the package index) when it is missing or holds
    other versions.

    Raises:
        GenerationError: the venv cannot be made or the pins installed (pip's output is named).
    """
    python = TOOLS_VENV / "bin" / "python"
    if python.exists() and _installed_versions(str(python)) == PINNED_VERSIONS:
        return str(python)
    pins = [f"{d}=={v}" for d, v in PINNED_VERSIONS.items()]
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(TOOLS_VENV)], check=True, capture_output=True, text=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins],
            check=True,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as e:
        raise GenerationError(f"cannot make {TOOLS_VENV} with {' '.join(pins)}:\n{e.stdout}{e.stderr}") from None
    return str(python)


def check_pinned_versions(python: str) -> None:
    """Refuse to generate with any grpcio-tools / mypy-protobuf other than the pinned ones.

    Raises:
        GenerationError: a tool is missing or at another version in ``python``'s environment.
    """
    installed = _installed_versions(python)
    problems = [
        f"{d}=={v} is required, found {installed[d] or 'none'}" for d, v in PINNED_VERSIONS.items() if installed[d] != v
    ]
    if problems:
        raise GenerationError(
            f"refusing to generate stubs with unpinned tools ({python}): "
            + "; ".join(problems)
            + f"; remove {TOOLS_VENV} and rerun to make it again"
        )


def _header(proto_paths: list[str]) -> str:
    tools = ", ".join(f"{d} {v}" for d, v in PINNED_VERSIONS.items())
    sources = ", ".join(f"protos/{p}" for p in proto_paths)
    return (
        f"# DO NOT EDIT: generated by {SCRIPT_NAME} ({tools}) from {sources}.\n"
        f"# Edit the .proto files and rerun the script.\n"
    )


def _stamp(text: str, header: str) -> str:
    """Put the header first, after a coding declaration if there is one (it must stay on line 1)."""
    first, sep, rest = text.partition("\n")
    if first.startswith("#") and "coding" in first:
        return first + sep + header + rest
    return header + text


def _find_protos() -> list[str]:
    paths = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))
    if not paths:
        raise GenerationError(f"no .proto files under {PROTO_ROOT}")
    return paths


def _check_imports(proto_paths: list[str]) -> None:
    for rel in proto_paths:
        for lineno, line in enumerate((PROTO_ROOT / rel).read_text().splitlines(), 1):
            stripped = line.strip()
            if not stripped.startswith("import "):
                continue
            target = stripped.split('"')[1] if '"' in stripped else stripped
            if not target.startswith(_ALLOWED_IMPORT_PREFIXES):
                raise GenerationError(
                    f"protos/{rel}:{lineno}: import {target!r} is not supported: the stubs are "
                    f"generated from a staged include root (<tmp>/{PROTO_PACKAGE.replace('.', '/')}/"
                    "...) so that their Python imports need no rewriting; a proto importing a "
                    "sibling needs that scheme extended (see this script's docstring)"
                )


def _write_plugin(path: Path, entry_point: str, python: str) -> Path:
    """A protoc plugin shim that runs mypy-protobuf in ``python`` (the tools' interpreter)."""
    # mypy-protobuf 5.1.0 ships its own descriptor module as protobuf 6.32 gencode; the tools' protobuf
    # is 5.29 (grpcio-tools 1.66.2 needs < 6), whose runtime check refuses newer gencode although the
    # module loads and works: the check is off in this plugin process only (its documented switch).
    path.write_text(
        f"#!{python}\nimport os, sys\nos.environ['TEMPORARILY_DISABLE_PROTOBUF_VERSION_CHECK'] = 'true'\n"
        f"from mypy_protobuf.main import {entry_point}\nsys.exit({entry_point}())\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _run_protoc(work: Path, proto_paths: list[str], out: Path, python: str) -> bytes:
    """Stage the protos, run protoc with all four generators; return the FileDescriptorSet bytes."""
    include = work / "include"
    staged_root = include / Path(*PROTO_PACKAGE.split("."))
    staged = []
    for rel in proto_paths:
        dest = staged_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PROTO_ROOT / rel, dest)
        staged.append(dest.relative_to(include).as_posix())
    mypy_plugin = _write_plugin(work / "protoc-gen-mypy", "main", python)
    mypy_grpc_plugin = _write_plugin(work / "protoc-gen-mypy_grpc", "grpc", python)
    descriptor_set = work / "descriptors.pb"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        python,
        "-m",
        "grpc_tools.protoc",
        "-I.",
        f"--plugin=protoc-gen-mypy={mypy_plugin}",
        f"--plugin=protoc-gen-mypy_grpc={mypy_grpc_plugin}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        f"--descriptor_set_out={descriptor_set}",
        "--include_source_info",  # the RPCs' comments, for rpcs_module's docstrings
        *staged,
    ]
    result = subprocess.run(cmd, cwd=include, capture_output=True, text=True)
    if result.returncode != 0:
        raise GenerationError(f"protoc failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return descriptor_set.read_bytes()


def _package_init(package: str, header: str, descriptor_set: bytes) -> str:
    """The ``__init__.py`` of ``package``: a docstring, plus re-exports where it holds stubs."""
    from google.protobuf import descriptor_pb2

    fds = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set)
    staged_prefix = PROTO_PACKAGE.replace(".", "/") + "/"
    sources: list[str] = []
    imports: list[tuple[str, list[str]]] = []
    for file in fds.file:
        module_package, _, module_name = file.name.removesuffix(".proto").replace("/", ".").rpartition(".")
        if module_package != package:
            continue
        sources.append("protos/" + file.name.removeprefix(staged_prefix))
        names = [m.name for m in file.message_type] + [e.name for e in file.enum_type]
        names += [value.name for enum in file.enum_type for value in enum.value]
        imports.append((f"{module_package}.{module_name}_pb2", sorted(names)))
        service_names = []
        for service in file.service:
            service_names += [
                f"{service.name}Servicer",
                f"{service.name}Stub",
                f"add_{service.name}Servicer_to_server",
            ]
        if service_names:
            imports.append((f"{module_package}.{module_name}_pb2_grpc", sorted(service_names)))
    proto_package = package.removeprefix(PROTO_PACKAGE).lstrip(".")
    if not imports:
        what = f"proto packages under {proto_package}" if proto_package else "the kvservice proto tree"
        return header + f'"""Generated stubs of {what} (see {SCRIPT_NAME})."""\n'
    lines = [
        header.rstrip("\n"),
        f'"""Messages, enums and service stubs of proto package {proto_package} ({", ".join(sources)})."""',
        "",
    ]
    all_names: list[str] = []
    for module, names in imports:
        lines.append(f"from {module} import (")
        lines += [f"    {name}," for name in names]
        lines.append(")")
        all_names += names
    lines += ["", "__all__ = ["]
    lines += [f'    "{name}",' for name in sorted(all_names)]
    lines.append("]")
    return "\n".join(lines) + "\n"


def _python_module(proto_name: str) -> str:
    """The Python module protoc makes of a .proto (``a/b/c.proto`` -> ``a.b.c_pb2``)."""
    return proto_name.removesuffix(".proto").replace("/", ".") + "_pb2"


def _snake_case(name: str) -> str:
    # As kvservice_client.rpc_table.snake_case (this script imports nothing of the package it writes).
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _comment_of(file: Any, path: tuple[int, ...]) -> str:
    for location in file.source_code_info.location:
        if tuple(location.path) == path:
            return " ".join(line.strip() for line in location.leading_comments.strip().splitlines())
    return ""


def _docstring(text: str, indent: str) -> str:
    """``text`` as a triple-quoted literal whose lines start with ``indent``."""
    text = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    lines = text.splitlines()
    return '"""' + lines[0] + "".join(f"\n{indent}{line}" if line else "\n" for line in lines[1:]) + f'\n{indent}"""'


def _wrapped(text: str, width: int, indent: str = "", hanging: str = "") -> list[str]:
    import textwrap

    return textwrap.wrap(
        text,
        width,
        initial_indent=indent,
        subsequent_indent=indent + hanging,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [""]


_SERVICE_FIELD = 6  # FileDescriptorProto.service
_METHOD_FIELD = 2  # ServiceDescriptorProto.method


def rpcs_module(file: Any, files: Sequence[Any], header: str) -> str | None:
    """The ``<name>_rpcs.py`` module of one .proto file: the clients' default method of each RPC of
    its service (see ``kvservice_client._facade``), or None when the file has no service.

    Each default takes the RPC's request message (an iterable of them when the client streams) and
    answers its response (an iterator of them when the server streams); its docstring is the RPC's
    comment in the proto. The client's table replaces some with friendlier signatures.

    Args:
        file: the file's ``FileDescriptorProto`` (with source info, for the comments).
        files: every file of the descriptor set (where the request and response types are found).
        header: the DO-NOT-EDIT header.

    Raises:
        GenerationError: more than one service in the file, or an RPC whose messages are not all
            defined in one file.
    """
    if not file.service:
        return None
    if len(file.service) > 1:
        raise GenerationError(f"{file.name}: {len(file.service)} services; the RPC module takes one per file")
    service = file.service[0]
    defined_in = {
        f".{f.package}.{m.name}" if f.package else f".{m.name}": (f.name, m.name) for f in files for m in f.message_type
    }
    modules = set()
    entries: list[tuple[str, str]] = []
    for index, method in enumerate(service.method):
        try:
            (request_file, request), (response_file, response) = (
                defined_in[method.input_type],
                defined_in[method.output_type],
            )
        except KeyError as e:
            raise GenerationError(f"{service.name}.{method.name}: type {e} is not a top-level message") from None
        modules |= {request_file, response_file}
        comment = _comment_of(file, (_SERVICE_FIELD, 0, _METHOD_FIELD, index)) or f"The {method.name} RPC."
        timeout = (
            "deadline for the whole call (None: none, whatever the client's default)."
            if method.server_streaming
            else "deadline in seconds or as a ``timedelta`` (None: the client's default)."
        )
        first = (
            f"requests: the ``{request}`` messages to send, in order (any iterable, read while sending)."
            if method.client_streaming
            else f"request: the ``{request}`` (None: an empty one)."
        )
        returns = (
            f"An iterator of ``{response}`` messages (an async iterator from the async client)."
            if method.server_streaming
            else f"The ``{response}``."
        )
        doc = "\n".join(
            [
                *_wrapped(comment, 96),
                "",
                "Args:",
                *_wrapped(first, 96, "    ", "    "),
                f"    timeout: {timeout}",
                "    metadata: extra metadata for this call.",
                "",
                "Returns:",
                f"    {returns}",
                "",
                "Raises:",
                "    KVServiceError: the call failed (the status code and the server's message).",
            ]
        )
        kind = "server_stream" if method.server_streaming else "unary"
        build = "request_stream" if method.client_streaming else "request_message"
        name = _snake_case(method.name)
        entries.append(
            (
                name,
                f'{name} = _facade.{kind}("{method.name}", _pb.{response})(\n'
                f"    _facade.{build}(\n"
                f"        _pb.{request},\n"
                f"        {_docstring(doc, ' ' * 8)},\n"
                f"    )\n"
                f")\n",
            )
        )
    if len(modules) != 1:
        raise GenerationError(
            f"{service.name}: its messages come from {len(modules)} files ({', '.join(sorted(modules))}); "
            "the RPC module imports one"
        )
    (module,) = modules
    package, _, name = _python_module(module).rpartition(".")
    class_name = f"{service.name}Methods"
    full_name = f"{file.package}.{service.name}" if file.package else service.name
    lines = [
        header.rstrip("\n"),
        f'"""The clients\' default method of each RPC of ``{full_name}``, typed, documented by the RPC\'s comment.',
        "",
        "Each takes the RPC's request message and answers its response; ``kvservice_client.client`` gives both",
        "clients one method per entry of :class:`" + class_name + "`, replacing some with friendlier signatures",
        '(see ``kvservice_client._facade``)."""',
        "",
        "from __future__ import annotations",
        "",
        "from kvservice_client import _facade",
        f"from {package} import {name} as _pb",
        "",
        "__all__ = [",
        *(f'    "{n}",' for n in sorted([class_name, *(n for n, _ in entries)])),
        "]",
        "",
    ]
    for _, text in entries:
        lines += ["", text]
    lines += [
        "",
        f"class {class_name}:",
        f'    """One client method per RPC of ``{full_name}``, in the proto\'s order."""',
        "",
        *(f"    {n} = {n}" for n, _ in entries),
    ]
    return "\n".join(lines) + "\n"


def generate(dest: Path) -> list[Path]:
    """Generate the whole ``_proto`` tree into ``dest`` (the directory that plays ``_proto/``).

    Returns:
        The files written, relative to ``dest``, sorted.

    Raises:
        GenerationError: unpinned tools, an unsupported import, or protoc failing.
    """
    from google.protobuf import descriptor_pb2

    python = tools_python()
    check_pinned_versions(python)
    proto_paths = _find_protos()
    _check_imports(proto_paths)
    header = _header(proto_paths)
    with tempfile.TemporaryDirectory(prefix="kvservice-gen-protos-") as tmp:
        work = Path(tmp)
        out = work / "out"
        descriptor_set = _run_protoc(work, proto_paths, out, python)
        generated_root = out / Path(*PROTO_PACKAGE.split("."))
        files: dict[Path, str] = {}
        for path in sorted(generated_root.rglob("*")):
            if path.is_file():
                if not path.name.endswith(_GENERATED_SUFFIXES):
                    raise GenerationError(f"unexpected generator output {path.relative_to(out)}")
                files[path.relative_to(generated_root)] = _stamp(path.read_text(), header)
    fds = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set)
    staged_prefix = PROTO_PACKAGE.replace(".", "/") + "/"
    for file in fds.file:
        if not file.name.startswith(staged_prefix):
            continue  # an imported well-known type (google/protobuf/...)
        text = rpcs_module(file, fds.file, header)
        if text is not None:
            files[Path(file.name.removeprefix(staged_prefix).removesuffix(".proto") + "_rpcs.py")] = text
    # Every directory from _proto down to each stub's folder is a regular package.
    package_dirs = {Path(".")}
    for rel in files:
        for parent in rel.parents:
            package_dirs.add(parent)
    for package_dir in sorted(package_dirs):
        package = ".".join([PROTO_PACKAGE, *package_dir.parts])
        files[package_dir / "__init__.py"] = _package_init(package, header, descriptor_set)
    # The sources ship beside their stubs (in the client wheel), for protoc users of other languages.
    for rel in proto_paths:
        files[Path(rel)] = (PROTO_ROOT / rel).read_text()
    dest.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text.encode("utf-8"))
    return sorted(files)


def _tree_files(root: Path) -> dict[Path, bytes]:
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def check() -> int:
    """Regenerate into a temp dir and compare with the committed tree.

    Returns:
        0 when the committed tree is byte-for-byte what the script generates, else 1 (after
        printing which files differ, are missing or are unexpected).
    """
    with tempfile.TemporaryDirectory(prefix="kvservice-gen-protos-check-") as tmp:
        fresh_root = Path(tmp) / "_proto"
        generate(fresh_root)
        fresh = _tree_files(fresh_root)
    committed = _tree_files(OUTPUT_DIR)
    shown = OUTPUT_DIR.relative_to(REPO_ROOT).as_posix()
    missing = sorted(set(fresh) - set(committed))
    unexpected = sorted(set(committed) - set(fresh))
    changed = sorted(p for p in set(fresh) & set(committed) if fresh[p] != committed[p])
    if not (missing or unexpected or changed):
        print(f"{shown}: up to date ({len(fresh)} files)")
        return 0
    print(f"{shown} is stale: {len(changed)} changed, {len(missing)} missing, {len(unexpected)} unexpected")
    for rel in changed:
        diff = list(
            difflib.unified_diff(
                committed[rel].decode("utf-8", "replace").splitlines(),
                fresh[rel].decode("utf-8", "replace").splitlines(),
                f"committed/{rel.as_posix()}",
                f"generated/{rel.as_posix()}",
                lineterm="",
                n=0,
            )
        )
        added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
        removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
        print(f"  changed     {rel.as_posix()} (+{added} -{removed} lines)")
        for line in diff[2:12]:
            print(f"      {line[:160]}")
        if len(diff) > 12:
            print("      ...")
    for rel in missing:
        print(f"  missing     {rel.as_posix()}")
    for rel in unexpected:
        print(f"  unexpected  {rel.as_posix()}")
    print(f"Regenerate with: python {SCRIPT_NAME}")
    return 1


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temp dir and exit 1 with a diff summary if the committed stubs are stale",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            return check()
        tmp_parent = OUTPUT_DIR.parent
        with tempfile.TemporaryDirectory(prefix=".gen-protos-", dir=tmp_parent) as tmp:
            staged = Path(tmp) / "_proto"
            written = generate(staged)
            if OUTPUT_DIR.exists():
                shutil.rmtree(OUTPUT_DIR)
            os.replace(staged, OUTPUT_DIR)
    except GenerationError as err:
        print(f"gen_protos: {err}", file=sys.stderr)
        return 2
    for rel in written:
        print(f"wrote {(OUTPUT_DIR / rel).relative_to(REPO_ROOT).as_posix()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
