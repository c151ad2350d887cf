"""The compiled block-hash chain (``kvservice_client._hashchain``) against the pure-Python rule.

The compiled path is optional: without a compiler the package installs without it and hashes
with the rule alone (checked here by installing it with ``CC=/bin/false``). Where it is built,
it must give byte-identical hashes: on vLLM's vectors and on random prompts, both algorithms
it covers, every token-size class and out-of-range ids (which fall back to the rule).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvservice_client.hashing as hashing
from kvservice_client.hashing import BlockHasher, LoRA
from tests.conftest import VECTORS_DIR

VECTORS = json.loads((VECTORS_DIR / "vllm_sha256_cbor_block_hashes.json").read_text())
compiled = pytest.mark.skipif(hashing._hashchain is None, reason="the compiled chain is not built here")


@pytest.fixture(params=["compiled", "rule"])
def path(request, monkeypatch):
    """Run a test with the compiled chain, and again with the pure-Python rule alone."""
    if request.param == "compiled" and hashing._hashchain is None:
        pytest.skip("the compiled chain is not built here")
    if request.param == "rule":
        monkeypatch.setattr(hashing, "_hashchain", None)
    return request.param


def reference(hasher: BlockHasher, tokens: list[int]) -> list[bytes]:
    """The rule block by block: ``hash_fn((parent, tuple(tokens), None))`` (cbor2 / pickle)."""
    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // hasher.block_size):
        parent = hasher.hash_block(parent, tokens[i * hasher.block_size : (i + 1) * hasher.block_size], None)
        out.append(parent)
    return out


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["name"])
def test_vllm_vectors_on_both_paths(path, case):
    hasher = BlockHasher(case["block_size"])
    lora = LoRA(1, case["lora"]["name"], case["lora"]["path"]) if case["lora"] else None
    hashes = hasher.hash_prompt(case["token_ids"], lora=lora, cache_salt=case["cache_salt"])
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]


@settings(max_examples=80, deadline=None)
@given(
    algorithm=st.sampled_from(["sha256_cbor", "sha256"]),
    block_size=st.sampled_from([1, 2, 3, 4, 5, 16, 23, 24, 300]),
    tokens=st.lists(
        st.one_of(
            st.integers(0, 30),
            st.integers(0, 300),
            st.integers(0, 70000),
            st.integers(0, 2**31 - 1),
            st.integers(2**31 - 2, 2**32 + 1),
            st.integers(-(2**40), 2**40),
        ),
        max_size=1500,
    ),
    split=st.integers(0, 1500),
)
def test_random_prompts_equal_the_rule(algorithm, block_size, tokens, split):
    hasher = BlockHasher(block_size, algorithm)
    expected = reference(hasher, tokens)
    assert hasher.hash_prompt(tokens) == expected
    # Incrementally (a decode's appends), from any point: the same chain.
    grown: list[bytes] = []
    hasher.extend(grown, tokens[:split])
    hasher.extend(grown, tokens)
    assert grown == expected


# The path fixture patches once per test and holds for every example.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    algorithm=st.sampled_from(["sha256_cbor", "sha256"]),
    block_size=st.sampled_from([1, 3, 4, 16, 300]),
    prompts=st.lists(
        st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**31 - 1), st.integers(-5, -1)), max_size=700),
        max_size=6,
    ),
)
def test_packed_prompts_hash_as_their_ids_on_both_paths(path, algorithm, block_size, prompts):
    """``hash_prompt(bytes)`` (little-endian int32, as the server reads ``packed_prompt_token_ids``),
    ``hash_packed`` and the chains a Step's prompts are hashed by beside the loop all give the
    rule's hashes of the ids; a negative id in a full block gives None from the compiled chain
    (the rule then hashes the ids as they are)."""
    hasher = BlockHasher(block_size, algorithm)
    packed = [struct.pack(f"<{len(ids)}i", *ids) for ids in prompts]
    for ids, data in zip(prompts, packed):
        assert hasher.hash_prompt(data) == reference(hasher, ids)
        fast = hasher.hash_packed(data)
        if path == "rule":
            assert fast is None
        else:
            hashed = ids[: len(ids) // block_size * block_size]  # ids past the last full block are not read
            assert fast == (None if any(t < 0 for t in hashed) else reference(hasher, ids))
    chains = hasher.packed_chains(packed)
    if path == "rule":
        assert chains is None
        return
    with ThreadPoolExecutor(1) as thread:
        ran = thread.submit(chains.run)
        assert [chains.hashes(i) for i in range(len(packed))] == [hasher.hash_packed(d) for d in packed]
        assert ran.result() is None
    assert [chains.hashes(i) for i in range(len(packed))] == [hasher.hash_packed(d) for d in packed]  # again


@compiled
def test_packed_chains_refuse_a_second_run_and_bad_shapes():
    hasher = BlockHasher(4)
    chains = hasher.packed_chains([struct.pack("<8i", *range(8)), b"abc", b""])
    chains.run()
    assert chains.hashes(0) == reference(hasher, list(range(8)))
    assert chains.hashes(1) is None and chains.hashes(2) == []  # not a multiple of 4 bytes; no full block
    with pytest.raises(RuntimeError, match="called already"):
        chains.run()
    with pytest.raises(IndexError):
        chains.hashes(3)
    with pytest.raises(ValueError, match="32 bytes"):
        hashing._hashchain.PackedChains([b""], 4, b"\0" * 8, 0)
    never_run = hashing._hashchain.PackedChains([b"\0" * 64], 4, b"\0" * 32, 0)
    del never_run  # freed without waiting for a run


@compiled
@pytest.mark.parametrize(("layout", "bad"), [(0, 2**32), (0, -1), (1, 2**31), (1, -1), (0, True), (1, 2.0)])
def test_compiled_chain_refuses_what_it_does_not_cover_and_appends_nothing(layout, bad):
    hashes = [b"x"]
    with pytest.raises(ValueError):
        hashing._hashchain.extend(hashes, [1, 2, 3, bad, 5, 6, 7, 8], 0, 2, 4, b"\0" * 32, layout)
    assert hashes == [b"x"]
    with pytest.raises(ValueError):
        hashing._hashchain.extend(hashes, [1, 2, 3, 4], 0, 1, 4, b"\0" * 8, layout)  # not a 32-byte parent
    assert hashes == [b"x"]


@compiled
def test_compiled_pickle_layout_is_pickles():
    # The digest of the pickle layout is the digest of pickle.dumps itself, for every tuple form.
    import hashlib

    parent = bytes(range(32))
    for block_size in (1, 2, 3, 4, 9):
        tokens = [0, 255, 256, 65535, 65536, 2**31 - 1, 7, 8, 9][:block_size]
        hashes: list[bytes] = []
        hashing._hashchain.extend(hashes, tokens, 0, 1, block_size, parent, 1)
        assert hashes == [hashlib.sha256(pickle.dumps((parent, tuple(tokens), None), protocol=5)).digest()]


def test_package_installs_and_hashes_without_a_compiler(tmp_path):
    # Built without isolation (no index needed): setuptools must be beside this Python, as it is in
    # the project's venv (the client-only venvs of scripts/check_client_pythons.py have none).
    pytest.importorskip("setuptools", minversion="77")  # the pyproject's build requirement
    target = tmp_path / "site"
    # A clean copy of the sources: a build/ folder left by an earlier build would be reused as is.
    client_dir = tmp_path / "src"
    shutil.copytree(
        os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python"),
        client_dir,
        ignore=shutil.ignore_patterns("build", "*.so", "*.egg-info", "__pycache__"),
    )
    env = {**os.environ, "CC": "/bin/false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-compile",
            "--target",
            str(target),
            str(client_dir),
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    assert not list(target.rglob("_hashchain*.so"))
    case = next(c for c in VECTORS["cases"] if not c["lora"] and not c["cache_salt"])
    script = (
        "import json, sys; import kvservice_client.hashing as h; assert h._hashchain is None, h._hashchain;"
        f"print(json.dumps([x.hex() for x in h.BlockHasher({case['block_size']}).hash_prompt({case['token_ids']!r})]))"
    )
    # -S: no .pth files, so the editable install of this checkout (and its built module) stays out;
    # the venv's site-packages come after the fresh install for numpy, cbor2 and xxhash.
    path = os.pathsep.join([str(target), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    out = subprocess.run(
        [sys.executable, "-S", "-c", script],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=str(tmp_path),
    )
    assert json.loads(out.stdout) == case["block_hashes_hex"]


def test_hash_prompt_of_any_byte_buffer_is_its_int32_ids_hashed_on_both_paths(path):
    """``hash_prompt`` of a packed prompt given as any memoryview (a non-contiguous one too, which
    the compiled chain cannot read in place: then the rule reads its bytes) or a bytearray hashes
    the little-endian int32 ids its bytes hold."""
    import numpy as np

    hasher = BlockHasher(4)
    ids = list(range(100, 164))
    expected = reference(hasher, ids[::2])
    strided = memoryview(np.array(ids, dtype="<i4"))[::2]
    assert not strided.c_contiguous
    assert hasher.hash_prompt(strided) == expected
    assert hasher.hash_prompt(memoryview(struct.pack("<64i", *ids)).cast("i")[::2]) == expected
    assert hasher.hash_prompt(bytearray(struct.pack("<32i", *ids[::2]))) == expected
    assert hasher.hash_prompt(memoryview(bytearray(struct.pack("<32i", *ids[::2])))) == expected
    # hash_packed reads only what it can read in place; else None (the caller hashes through extend).
    assert hasher.hash_packed(strided) is None
    assert hasher.hash_packed(np.array(ids, dtype="<i4")[::2]) is None


@compiled
@pytest.mark.skipif(sys.version_info < (3, 12), reason="a class's __buffer__ (PEP 688) is Python 3.12's")
def test_packed_chains_read_the_prompts_as_they_were_when_a_buffer_export_changes_the_list():
    """Exporting a prompt's buffer may run Python code (a class's ``__buffer__``) that empties
    the very list being read: the chains read the prompts it held when called. (Before, they read
    the list's freed items: a segmentation fault under Python 3.12.1.)"""
    hasher = BlockHasher(4)
    prompts: list = []
    junk: list = []

    class Clears:
        def __buffer__(self, flags: int) -> memoryview:
            prompts.clear()  # frees the other prompts: only the list held them
            junk.extend(bytes([255 - i % 7]) * 32 for i in range(400))  # reuses their memory
            return memoryview(struct.pack("<4i", 1, 2, 3, 4))

    prompts.extend([Clears(), *(struct.pack("<8i", *range(i, i + 8)) for i in range(64))])
    chains = hasher.packed_chains(prompts)
    assert prompts == [] and len(junk) == 400
    chains.run()
    assert chains.hashes(0) == reference(hasher, [1, 2, 3, 4])
    assert [chains.hashes(i + 1) for i in range(64)] == [reference(hasher, list(range(i, i + 8))) for i in range(64)]


@compiled
def test_packed_chains_release_every_prompt_they_hold():
    """Chains hold each prompt's buffer until freed, run or not, and a construction that fails
    part-way releases the ones it took: the prompts' reference counts come back exactly."""
    import numpy as np

    hasher = BlockHasher(4)
    data = struct.pack("<16i", *range(16))
    array_prompt = np.arange(16, dtype="<i4")
    before = sys.getrefcount(data), sys.getrefcount(array_prompt)
    for _ in range(100):
        chains = hasher.packed_chains([data, array_prompt, data])
        assert sys.getrefcount(data) == before[0] + 2 and sys.getrefcount(array_prompt) == before[1] + 1
        with ThreadPoolExecutor(1) as thread:
            thread.submit(chains.run)
            assert chains.hashes(1) == chains.hashes(2) == reference(hasher, list(range(16)))
        del chains
    never_run = hasher.packed_chains([data])
    del never_run
    with pytest.raises(ValueError, match="not C-contiguous"):
        hasher.packed_chains([data, array_prompt, np.arange(32, dtype="<i4")[::2]])
    assert (sys.getrefcount(data), sys.getrefcount(array_prompt)) == before
