"""The ``kvservice`` command: ``serve``, ``watch``, ``replay``."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import click

from kvservice.core.kv_cache_spec import PRESETS
from kvservice_client.hashing import HASH_ALGORITHMS

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--log-level", default="WARNING", show_default=True, help="Python logging level.",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False))
def main(log_level: str) -> None:
    """kvservice: a KV-cache control service (vLLM-style prefix caching over gRPC)."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC core's own INFO lines (GOAWAY...) are noise here
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _positive_finite(param: click.Parameter, value: float) -> float:
    import math

    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"must be a finite number > 0; got {value}", param=param)
    return value


def _server_options(func: Any) -> Any:
    options = [
        click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), help="TOML file of settings (keys as the flags, with _)."),
        click.option("--host", help="Address to bind [127.0.0.1]."),
        click.option("--port", type=int, help="Port to bind; 0 picks a free one [50051]."),
        click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Model KV layout [llama-3-8b]."),
        click.option("--block-size", type=int, help="Tokens per block [the preset's]."),
        click.option("--num-blocks", type=int, help="Blocks in the pool [from the memory budget]."),
        click.option("--kv-cache-memory", help="KV tensor budget in bytes, e.g. 512MiB [1GiB on CPU]."),
        click.option("--gpu-memory-utilization", type=float, help="Fraction of free CUDA memory for KV [0.9 on CUDA]."),
        click.option("--device", help="auto | cpu | cuda[:N] | meta (shapes only) [auto]."),
        click.option("--max-model-len", type=int, help="Longest request in tokens [the preset's]."),
        click.option("--hash-algorithm", type=click.Choice(HASH_ALGORITHMS), help="Block-hash rule [sha256_cbor]."),
        click.option("--hash-seed", help="Root seed of the block hashes [vllm-none-hash]."),
        click.option("--block-hash-format", type=click.Choice(["int64", "digest"]), help="Hashes on events [int64]."),
        click.option("--data-parallel-rank", type=int, help="Rank copied onto every event batch."),
        click.option("--event-max-batches", type=int, help="Event batches retained for replay [100000]."),
        click.option("--event-max-bytes", help="Bytes the event log holds for replay (msgpack, cached encodings, overhead) [256MiB]."),
        click.option("--max-subscriber-lag", type=int, help="Batches a subscriber may fall behind [10000]."),
        click.option("--check-invariants/--no-check-invariants", default=None,
                     help="Debug: check the cache's invariants after every mutating call (slow) [off]."),
        # -- auth options --
        click.option("--tls-cert-file", type=click.Path(exists=True, dir_okay=False),
                     help="Server TLS certificate chain, PEM (with --tls-key-file) [plain text]."),
        click.option("--tls-key-file", type=click.Path(exists=True, dir_okay=False),
                     help="Server TLS private key, PEM, unencrypted."),
        click.option("--tls-client-ca-file", type=click.Path(exists=True, dir_okay=False),
                     help="CA certificates, PEM: require client certificates signed by them (mutual TLS)."),
        click.option("--auth-tokens-file", type=click.Path(exists=True, dir_okay=False),
                     help="TOML file of bearer tokens with roles scheduler/watcher [no tokens]."),
        click.option("--allow-insecure-bind", is_flag=True, default=None,
                     help="Bind a non-loopback host with neither TLS nor tokens, or a ZMQ endpoint off loopback "
                          "(no auth there at all; refused otherwise)."),
        # -- limits and request lifetime options --
        click.option("--max-num-requests", type=int, help="Registered requests at once [65536]."),
        click.option("--max-step-ops", type=int, help="Ops per Step [4096]."),
        click.option("--max-step-tokens", type=int,
                     help="Tokens per Step, prompt + new over all ops; bounds how long a Step holds the loop [262144]."),
        click.option("--max-message-bytes", help="Largest gRPC message, e.g. 64MiB [64MiB]."),
        click.option("--max-streams", type=int, help="Open StreamEvents subscriptions [1024]."),
        click.option("--max-consumers", type=int, help="Named TakeEvents consumers [1024]."),
        click.option("--consumer-idle-timeout-s", type=float,
                     help="Drop a TakeEvents consumer that has not taken for this long, seconds [3600]."),
        click.option("--request-idle-timeout-s", type=float,
                     help="Free a request not called for this long, seconds [off]."),
        # -- ZMQ publisher options --
        click.option("--zmq-endpoint", help="Publish KV events vLLM-style on this ZMQ PUB endpoint, e.g. tcp://*:5557 (bound; off loopback needs --allow-insecure-bind; tcp://host:port connects) [off]."),
        click.option("--zmq-replay-endpoint", help="ZMQ ROUTER endpoint answering vLLM replay requests, always bound, e.g. tcp://*:5558 (off loopback needs --allow-insecure-bind) [off]."),
        click.option("--zmq-topic", help="Topic frame of every ZMQ message [\"\"]."),
        click.option("--zmq-hwm", type=int, help="ZMQ PUB high-water mark, messages per subscriber [100000]."),
        # -- NATS JetStream options --
        click.option("--nats-url", help="Publish KV events to NATS JetStream at this URL, e.g. nats://nats:4222 (comma-separated for several) [off]."),
        click.option("--nats-subject-prefix", help="Subjects are <prefix>.<instance>; the stream takes <prefix>.> [kvservice.events]."),
        click.option("--nats-stream", help="JetStream stream, created or updated at start [KVSERVICE_EVENTS]."),
        click.option("--nats-instance", help="This server's subject token, [A-Za-z0-9_-]+ [<hostname>-<port>]."),
        click.option("--nats-max-age-s", type=float, help="Stream retention by age, seconds; 0 = no limit [3600]."),
        click.option("--nats-max-msgs", type=int, help="Stream retention by count, messages; 0 = no limit [0]."),
        click.option("--nats-max-bytes", help="Stream retention by size, e.g. 1GiB; 0 = no limit [1GiB]."),
        click.option("--nats-duplicate-window-s", type=float, help="Seconds a re-published batch (same Nats-Msg-Id) is dropped [120]."),
        click.option("--nats-max-pending-batches", type=int, help="Batches queued while NATS is away before new ones are dropped [10000]."),
        # -- metrics options --
        click.option("--metrics-port", type=int, help="Prometheus metrics HTTP port; 0 picks a free one [off]."),
        click.option("--metrics-host", help="Address the metrics endpoint binds [127.0.0.1]."),
        # -- bounded cost options (issue 15) --
        click.option("--max-snapshot-cuts", type=int, help="Snapshots cut at once; callers at one head share a cut [2]."),
        click.option("--max-waiting-tokens", type=int,
                     help="Prompt tokens held by waiting (not yet admitted) requests; 0 = no bound [8388608]."),
        click.option("--keepalive-time-s", type=float, help="Seconds between HTTP/2 keepalive pings to a client [30]."),
        click.option("--keepalive-timeout-s", type=float, help="Seconds a keepalive ping may go unanswered [10]."),
        click.option("--keepalive-min-client-interval-s", type=float,
                     help="Most often a client may ping on a quiet connection, seconds [5]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@main.command()
@_server_options
def serve(config_file: str | None, **flags: Any) -> None:
    """Run the service until SIGTERM/SIGINT (flags > KVSERVICE_* env > --config file > defaults)."""
    from kvservice.server.app import load_config, run_server

    try:
        config = load_config(config_file, **flags)
        asyncio.run(run_server(config))
    except (ValueError, MemoryError, OSError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("target", default="127.0.0.1:50051")
@click.option("--snapshot/--live", default=False, help="Start with a snapshot of the cached set, or live [live].")
@click.option("--from-seq", type=int, help="Replay retained batches from this seq, then follow live.")
@click.option("--group", "group_idxs", type=click.IntRange(min=0), multiple=True, help="Only this group's events (repeatable).")
@click.option("--token", envvar="KVSERVICE_TOKEN", show_envvar=True, help="Bearer token (prefer the environment variable: a flag shows in ps).")
@click.option("--tls", "use_tls", is_flag=True, help="Connect with TLS (implied by --tls-ca/--tls-cert) [plain text].")
@click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False),
              help="CA certificates (PEM) that the server's certificate must chain to [the system's].")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False),
              help="Client certificate chain, PEM, for mutual TLS (with --tls-key).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="Client private key, PEM (with --tls-cert).")
@click.option("--reconnect/--no-reconnect", default=True,
              help="Reopen an ended stream and resume in the same epoch (after a restart: a line says so, and "
                   "--snapshot resyncs) [reconnect]; --no-reconnect exits at the first end.")
def watch(
    target: str, snapshot: bool, from_seq: int | None, group_idxs: tuple[int, ...], token: str | None,
    use_tls: bool, tls_ca: str | None, tls_cert: str | None, tls_key: str | None, reconnect: bool,
) -> None:
    """Print the live KV event stream of TARGET (host:port), one line per event.

    A stream that ends is reopened and resumes from the next seq in the same epoch; after a server
    restart (a new epoch) a line starting "# epoch changed" says so, and with --snapshot a snapshot
    of the new cached set follows. --no-reconnect: exit (status 1) when the stream ends.
    """
    from pathlib import Path

    import grpc

    from kvservice.watch import watch_events
    from kvservice_client.client import KVServiceError

    if snapshot and from_seq is not None:
        raise click.UsageError("--snapshot and --from-seq cannot be used together")
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    credentials = None
    if use_tls or tls_ca or tls_cert:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
            private_key=Path(tls_key).read_bytes() if tls_key else None,
            certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
        )
    try:
        asyncio.run(watch_events(
            target, snapshot=snapshot, start_seq=from_seq, group_idxs=group_idxs, token=token, credentials=credentials,
            reconnect=reconnect,
        ))
    except KeyboardInterrupt:
        pass
    except KVServiceError as e:
        click.echo(f"# {e.message}", err=True)
        sys.exit(1)


@main.command()
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), help="Trace file [the embedded Mooncake sample].")
@click.option("--format", "trace_format", type=click.Choice(["auto", "mooncake", "azure", "tokens"]), default="auto", show_default=True, help="Trace format.")
@click.option("--limit", type=click.IntRange(min=1), help="Replay only the first N requests (N >= 1).")
@click.option("--target", help="An existing server HOST:PORT (its prefix cache is reset before each mode).")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="llama-3-8b", show_default=True, help="Embedded server's model KV layout.")
@click.option("--block-size", type=int, help="Embedded server's block size in tokens [the preset's].")
@click.option("--num-blocks", type=int, default=32768, show_default=True, help="Embedded server's pool, in blocks.")
@click.option("--device", default="meta", show_default=True, help="Embedded server's KV tensors: meta (shapes only), cpu, cuda[:N].")
@click.option("--report-mode", type=click.Choice(["incremental", "full", "both"]), help="kv_cache_report_mode to replay (both: two fresh servers, same trace) [both; full with --instances].")
@click.option("--watchers", type=click.IntRange(min=1), default=1, show_default=True, help="Watchers per mode (each mirrors and predicts).")
@click.option("--late-watcher/--no-late-watcher", default=True, show_default=True, help="Add a watcher that joins halfway through from a snapshot.")
@click.option("--mirror-capacity", type=click.IntRange(min=0), help="Watcher mirror size in blocks (0: unbounded) [half the pool].")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=32, show_default=True, help="Most running requests.")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True, help="Token budget per step.")
@click.option("--step-ms", type=float, default=20.0, show_default=True, help="Simulated milliseconds per step (> 0).",
              callback=lambda ctx, param, v: _positive_finite(param, v))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="kvservice-replay", show_default=True, help="Where report.json and agreement.png go.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Draw progress bars.")
# -- multi-instance routing option --
@click.option("--instances", type=click.IntRange(min=1, max=64), default=1, show_default=True, help="N >= 2: route over N embedded servers of --num-blocks each by the mirrors' predicted hit, against round-robin; writes routing.json.")
@click.option("--rate-scale", type=float, help="With --instances: arrival-rate multiplier (arrival times divided by it) [N].")
@click.option("--nats-url", help="With --instances: every server publishes to this NATS JetStream (a stream per policy run, deleted after) and the router's mirrors are fed over it, not over gRPC StreamEvents.")
def replay(**options: Any) -> None:
    """Replay a serving trace through the service and report hits and watcher agreement."""
    from pathlib import Path

    if options["instances"] >= 2:
        _replay_instances(options)
        return
    if options["nats_url"] is not None:
        raise click.UsageError("--nats-url feeds the router's mirrors of --instances N (N >= 2)")

    from kvservice.replay.report import plot_agreement, render_table, write_json
    from kvservice.replay.runner import ReplayConfig, run_replay
    from kvservice.replay.scheduler import SchedulerConfig

    modes = ("incremental", "full") if options["report_mode"] in (None, "both") else (options["report_mode"],)
    config = ReplayConfig(
        trace=options["trace"],
        trace_format=options["trace_format"],
        limit=options["limit"],
        target=options["target"],
        preset=options["preset"],
        block_size=options["block_size"],
        num_blocks=options["num_blocks"],
        device=options["device"],
        report_modes=modes,
        watchers=options["watchers"],
        late_watcher=options["late_watcher"],
        mirror_capacity=options["mirror_capacity"],
        scheduler=SchedulerConfig(
            max_num_seqs=options["max_num_seqs"],
            max_num_batched_tokens=options["max_num_batched_tokens"],
            step_ms=options["step_ms"],
        ),
        show_progress=options["progress"],
    )
    from kvservice_client.client import KVServiceError

    try:
        report = asyncio.run(run_replay(config))
    except KVServiceError as e:
        where = options["target"] or "the embedded server"
        raise click.ClickException(f"{where}: {e.code.name}: {e.message}") from None
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    out = Path(options["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_json(report, out / "report.json")
    png_path = plot_agreement(report, out / "agreement.png")
    click.echo(render_table(report))
    click.echo(f"wrote {json_path} and {png_path}")


def _replay_instances(options: dict[str, Any]) -> None:
    """``replay --instances N`` (N >= 2): routed against round-robin (kvservice.replay.multi)."""
    from pathlib import Path

    from kvservice.replay.multi import MultiReplayConfig, render_multi_table, run_multi_replay, write_multi_json
    from kvservice.replay.scheduler import SchedulerConfig
    from kvservice_client.client import KVServiceError

    if options["target"] is not None:
        raise click.UsageError("--instances runs its own servers; it cannot use --target")
    if options["report_mode"] == "both":
        raise click.UsageError("--instances compares routing in one report mode: choose incremental or full")
    try:
        config = MultiReplayConfig(
            trace=options["trace"], trace_format=options["trace_format"], limit=options["limit"],
            instances=options["instances"], preset=options["preset"], block_size=options["block_size"],
            num_blocks=options["num_blocks"], rate_scale=options["rate_scale"], device=options["device"],
            report_mode=options["report_mode"] or "full",
            mirror_capacity=options["mirror_capacity"],
            scheduler=SchedulerConfig(max_num_seqs=options["max_num_seqs"],
                                      max_num_batched_tokens=options["max_num_batched_tokens"],
                                      step_ms=options["step_ms"]),
            show_progress=options["progress"],
            nats_url=options["nats_url"],
        )
        report = asyncio.run(run_multi_replay(config))
    except KVServiceError as e:
        raise click.ClickException(f"an embedded server: {e.code.name}: {e.message}") from None
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    json_path = write_multi_json(report, Path(options["out_dir"]) / "routing.json")
    click.echo(render_multi_table(report))
    click.echo(f"wrote {json_path}")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Run the benchmark suite (scripts/bench/run.py of a source checkout; its flags pass through,
    e.g. --quick, --only core,rpc, --json FILE)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "run.py"
    if not script.exists():
        raise click.ClickException(f"kvservice bench needs a source checkout ({script} is missing)")
    sys.exit(subprocess.call([sys.executable, str(script), *ctx.args]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
