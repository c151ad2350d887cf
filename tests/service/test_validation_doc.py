"""docs/VALIDATION.md is what scripts/gen_validation_doc.py generates from the bad-input table now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gen_validation_doc.py"


def test_the_validation_doc_is_fresh(capsys):
    spec = importlib.util.spec_from_file_location("gen_validation_doc", SCRIPT)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0, f"stale: run python scripts/gen_validation_doc.py\n{capsys.readouterr().out}"
    text = gen.DOC_PATH.read_text()
    from tests.service.test_bad_input import CASES

    assert sum(line.startswith("| ") for line in text.splitlines()) - 2 == len(CASES)  # + header and rule
