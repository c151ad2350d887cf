"""``kvservice replay``: every option checked before anything starts, and the first line says at
once what is about to run."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import kvservice.replay.runner as runner
from kvservice.cli import main


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--max-num-batched-tokens", "2000000"],
            "Invalid value for '--max-num-batched-tokens': 2000000 is above the embedded server's max_step_tokens "
            "(262144 tokens per Step)",
        ),
        (
            ["--num-blocks", "64", "--mirror-capacity", "100"],
            "Invalid value for '--mirror-capacity': 100 is above the pool (63 blocks; 0: unbounded)",
        ),
        (["--num-blocks", "0"], "the embedded server: num_blocks must be >= 1; got 0"),
        (["--nats-url", "nats://x:4222"], "--nats-url feeds the router's mirrors of --instances N (N >= 2)"),
        (["--instances", "2", "--report-mode", "both"], "--instances compares routing in one report mode"),
    ],
)
def test_bad_options_fail_before_anything_starts(args, message, monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("the replay started")

    monkeypatch.setattr(runner, "load_requests", must_not_run)
    result = CliRunner().invoke(main, ["replay", "--no-progress", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not result.output.startswith("replay:")


def test_the_first_line_comes_before_the_replay_starts(monkeypatch, tmp_path):
    seen = []

    async def fake_run_replay(config, **kwargs):
        seen.append(config)
        raise ValueError("stop here")

    monkeypatch.setattr(runner, "run_replay", fake_run_replay)
    result = CliRunner().invoke(
        main, ["replay", "--limit", "5", "--mirror-capacity", "0", "--no-progress", "--out", str(tmp_path)]
    )
    assert result.exit_code == 1 and seen
    assert result.output.splitlines()[0] == (
        "replay: the embedded Mooncake sample, first 5 requests; preset llama-3-8b, pool 32,768 blocks of 16 "
        "tokens, mirror unbounded; report mode incremental and full; 1 watcher(s) + a late one"
    )


@pytest.mark.parametrize("mode", ["vllm", "vllm-tier"])
def test_a_vllm_mode_without_kvservice_vllm_says_how_to_install_it(mode, monkeypatch, tmp_path):
    """Where kvservice-vllm is not installed (this venv: ``.venv`` has no vLLM), the vLLM modes
    end with one line naming the missing module and the setup script, no traceback."""
    import importlib.util

    if importlib.util.find_spec("kvservice_vllm") is not None:
        pytest.skip("kvservice-vllm is installed here")
    result = CliRunner().invoke(main, ["replay", "--scheduler", mode, "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == (
        f"Error: replay --scheduler {mode} needs vLLM 0.33 and kvservice-vllm (kvservice_vllm is missing): "
        f"bash scripts/setup_vllm.sh, then .venv-vllm/bin/kvservice replay --scheduler {mode}"
    )
