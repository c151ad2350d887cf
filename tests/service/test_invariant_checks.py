"""The ``check_invariants`` debug setting: one check after every successful call and Step; a failure
is counted, recorded and logged at ERROR, and changes no answer."""

from __future__ import annotations

import logging

import grpc
import pytest

from kvservice.server.app import load_config
from kvservice_client.client import KVServiceError, StepBuilder

pytestmark = pytest.mark.timeout(60)


async def test_one_check_after_every_successful_call_and_step(start_kv_server, connect) -> None:
    running = await start_kv_server(check_invariants=True)
    client = await connect(running)
    await client.get_computed_blocks("A", range(1, 10))
    await client.allocate_slots("A", 9)
    await client.get_usage()
    await client.step(StepBuilder().allocate_slots("A", 1, new_token_ids=[7]).free("nobody"))  # one op fails
    with pytest.raises(KVServiceError) as err:
        await client.allocate_slots("nobody", 1)  # a failed call changes nothing: no check
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    servicer = running.servicer
    assert (servicer.num_invariant_checks, servicer.num_invariant_failures, servicer.invariant_failures) == (4, 0, [])


async def test_a_failed_check_is_recorded_and_logged_and_the_call_still_answers(
    start_kv_server, connect, caplog
) -> None:
    running = await start_kv_server(check_invariants=True)
    client = await connect(running)
    await client.get_computed_blocks("A", range(1, 10))
    await client.allocate_slots("A", 9)
    running.engine.running.discard("A")  # corrupt: A holds blocks but is no longer running
    with caplog.at_level(logging.ERROR, logger="kvservice.server.servicer"):
        usage = await client.get_usage()
    assert usage.num_free_blocks == 15 - 3
    servicer = running.servicer
    assert (servicer.num_invariant_checks, servicer.num_invariant_failures) == (3, 1)
    assert servicer.invariant_failures == ["A holds blocks but is not running"]
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == "invariant check 3 failed (head seq 1): A holds blocks but is not running"


async def test_off_by_default(kv_server, client) -> None:
    await client.get_computed_blocks("A", range(1, 10))
    assert kv_server.config.cache.check_invariants is False
    assert kv_server.servicer.num_invariant_checks == 0


def test_the_setting_from_env_toml_and_flags(tmp_path) -> None:
    assert load_config(None, {"KVSERVICE_CHECK_INVARIANTS": "true"}).cache.check_invariants is True
    assert load_config(None, {"KVSERVICE_CHECK_INVARIANTS": "0"}).cache.check_invariants is False
    toml = tmp_path / "kv.toml"
    toml.write_text("check_invariants = true\n")
    assert load_config(toml, {}).cache.check_invariants is True
    assert load_config(toml, {}, check_invariants=False).cache.check_invariants is False
    with pytest.raises(ValueError, match="KVSERVICE_CHECK_INVARIANTS: check_invariants: not a boolean: 'maybe'"):
        load_config(None, {"KVSERVICE_CHECK_INVARIANTS": "maybe"})


def test_the_serve_flag(monkeypatch) -> None:
    from click.testing import CliRunner

    import kvservice.server.app as app
    from kvservice.cli import main

    seen = []

    async def fake_run_server(config, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(config.cache.check_invariants)

    monkeypatch.setattr(app, "run_server", fake_run_server)
    for args in (["--check-invariants"], ["--no-check-invariants"], []):
        result = CliRunner().invoke(main, ["serve", *args], env={"KVSERVICE_CHECK_INVARIANTS": None})
        assert result.exit_code == 0, result.output
    assert seen == [True, False, False]
