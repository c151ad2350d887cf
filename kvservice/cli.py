"""The ``kvservice`` command: ``serve``, ``watch``, ``replay``."""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvservice.core.model_config import PRESETS

if TYPE_CHECKING:
    from kvservice.replay.plot_process import PlotProcess
    from kvservice.server.settings import SettingInfo

__all__ = ["main"]

_F = TypeVar("_F", bound=Callable[..., object])


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from kvservice.server.build_info import describe_version

    click.echo(describe_version())
    ctx.exit()


class _Group(click.Group):
    """The ``kvservice`` group. With ``--log-format json`` asked for (the flag, or
    ``KVSERVICE_LOG_FORMAT=json``) a command-line error is one JSON line too (``logger``
    "kvservice.cli", ``level`` ERROR, the ``usage`` when it is a usage error), as every other
    line of ``kvservice serve`` is."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Run the command line (as click's; see the class docstring for the errors)."""
        if _requested_log_format() != "json" or kwargs.get("standalone_mode") is False:
            return super().main(*args, **kwargs)
        from kvservice.server.observability import json_line

        try:
            return super().main(*args, **{**kwargs, "standalone_mode": False})
        except click.ClickException as e:
            usage = {"usage": e.ctx.get_usage()} if isinstance(e, click.UsageError) and e.ctx is not None else {}
            print(json_line("ERROR", "kvservice.cli", e.format_message(), **usage), file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
        except click.Abort:
            print(json_line("ERROR", "kvservice.cli", "aborted"), file=sys.stderr, flush=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the version and build (git commit, Python, grpcio, protobuf) and exit.",
)
@click.option(
    "--log-level",
    default=None,
    help="Python logging level [WARNING]; `serve --log-level` too.",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
)
@click.pass_context
def main(ctx: click.Context, log_level: str | None) -> None:
    """kvservice: a KV-cache control service (vLLM-style prefix caching over gRPC)."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC core's own INFO lines (GOAWAY...) are noise here
    ctx.obj = {"log_level": log_level}
    logging.basicConfig(
        level=(log_level or "WARNING").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _log_level_option(func: _F) -> _F:
    """``--log-level`` after the subcommand too (``kvservice watch --log-level DEBUG``)."""

    def apply(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        if value is not None:
            logging.getLogger().setLevel(value.upper())

    return click.option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
        expose_value=False,
        callback=apply,
        help="Python logging level [WARNING].",
    )(func)


def _positive_finite(param: click.Parameter, value: float) -> float:
    import math

    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"must be a finite number > 0; got {value}", param=param)
    return value


def _server_option(row: SettingInfo) -> Callable[[_F], _F]:
    """The ``kvservice serve`` option of one setting (a row of ``settings_table()``)."""
    kwargs: dict[str, Any] = {"help": row.help, "default": None}
    if row.type == "bool":
        return click.option(f"{row.option}/--no-{row.option[2:]}", row.flat, **kwargs)
    names = [row.option, *row.alias_options, row.flat]
    if row.meta.path:
        kwargs["type"] = click.Path(exists=True, dir_okay=False)
    elif row.meta.choices is not None:
        kwargs["type"] = click.Choice(list(row.meta.choices), case_sensitive=row.flat != "log_level")
    elif row.type in ("int", "float"):
        kwargs["type"] = {"int": click.INT, "float": click.FLOAT}[row.type]
    return click.option(*names, **kwargs)


def _server_options(func: _F) -> _F:
    """Every setting of ``kvservice.server.settings`` as an option (generated from the table, so
    a setting added there is an option here), and ``--config``."""
    from kvservice.server.settings import settings_table

    options = [
        click.option(
            "--config",
            "config_file",
            type=click.Path(exists=True, dir_okay=False),
            help="TOML file of settings (keys as the flags, with _ or -).",
        )
    ]
    options += [_server_option(row) for row in settings_table().values()]
    for option in reversed(options):
        func = option(func)
    return func


@main.command()
@_server_options
@click.pass_context
def serve(ctx: click.Context, config_file: str | None, **flags: Any) -> None:
    """Run the service until SIGTERM/SIGINT (flags > KVSERVICE_* env > --config file > defaults)."""
    from kvservice.server.app import ServerConfig, load_config, run_server
    from kvservice.server.observability import configure_logging, log_uncaught_exceptions_and_warnings

    if flags.get("log_level") is None:  # `kvservice --log-level X serve` as well as `serve --log-level X`
        flags["log_level"] = (ctx.obj or {}).get("log_level")
    config: ServerConfig | None = None
    with _HeldLogRecords() as held:  # an unknown KVSERVICE_* variable is logged in the format chosen
        try:
            config = load_config(config_file, **flags)
        except ValueError as e:
            failure = str(e)
    if config is not None:
        level, log_format = config.logging.log_level, config.logging.log_format
    else:  # the settings did not load: their error goes out in the format asked for, if any
        level, log_format = flags["log_level"] or "WARNING", _requested_log_format(flags)
    held.release(configure_logging(level, log_format))
    if log_format == "json":
        log_uncaught_exceptions_and_warnings()
    try:
        if config is None:
            raise ValueError(failure)
        asyncio.run(run_server(config))
    except (ValueError, MemoryError, OSError, RuntimeError) as e:
        if log_format == "json":
            logging.getLogger("kvservice.cli").error(str(e))
            sys.exit(1)
        raise click.ClickException(str(e)) from None


class _HeldLogRecords:
    """While open, the root logger's records are held instead of written; :meth:`release` hands
    them to a handler (those at or above the root's level by then)."""

    def __enter__(self) -> _HeldLogRecords:
        import logging.handlers

        self._root = logging.getLogger()
        self._saved = list(self._root.handlers)
        self._held = logging.handlers.BufferingHandler(capacity=1 << 16)
        for handler in self._saved:
            self._root.removeHandler(handler)
        self._root.addHandler(self._held)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._root.removeHandler(self._held)
        for handler in self._saved:
            self._root.addHandler(handler)

    def release(self, handler: logging.Handler) -> None:
        for record in self._held.buffer:
            if record.levelno >= self._root.getEffectiveLevel():
                handler.handle(record)
        self._held.buffer.clear()


def _requested_log_format(flags: dict[str, Any] | None = None) -> str:
    """The log format asked for on the command line or in ``KVSERVICE_LOG_FORMAT`` (for output
    made before, or without, loaded settings): "json" or "text"."""
    asked = (flags or {}).get("log_format") or os.environ.get("KVSERVICE_LOG_FORMAT")
    if asked is None:
        args = sys.argv[1:]
        for i, arg in enumerate(args):
            if arg == "--log-format" and i + 1 < len(args):
                asked = args[i + 1]
            elif arg.startswith("--log-format="):
                asked = arg.split("=", 1)[1]
    return "json" if str(asked).lower() == "json" else "text"


@main.command()
@_log_level_option
@click.argument("target", default="127.0.0.1:50051")
@click.option("--snapshot/--live", default=False, help="Start with a snapshot of the cached set, or live [live].")
@click.option(
    "--from-seq", type=click.IntRange(min=1), help="Replay retained batches from this seq (>= 1), then follow live."
)
@click.option(
    "--group", "group_idxs", type=click.IntRange(min=0), multiple=True, help="Only this group's events (repeatable)."
)
@click.option(
    "--token",
    envvar="KVSERVICE_TOKEN",
    show_envvar=True,
    help="Bearer token (prefer the environment variable: a flag shows in ps).",
)
@click.option("--tls", "use_tls", is_flag=True, help="Connect with TLS (implied by --tls-ca/--tls-cert) [plain text].")
@click.option(
    "--tls-ca",
    type=click.Path(exists=True, dir_okay=False),
    help="CA certificates (PEM) that the server's certificate must chain to [the system's].",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    help="Client certificate chain, PEM, for mutual TLS (with --tls-key).",
)
@click.option(
    "--tls-key", type=click.Path(exists=True, dir_okay=False), help="Client private key, PEM (with --tls-cert)."
)
@click.option(
    "--reconnect/--no-reconnect",
    default=True,
    help="Reopen an ended stream and resume in the same epoch (after a restart: a line says so, and "
    "--snapshot resyncs) [reconnect]; --no-reconnect exits at the first end.",
)
def watch(
    target: str,
    snapshot: bool,
    from_seq: int | None,
    group_idxs: tuple[int, ...],
    token: str | None,
    use_tls: bool,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    reconnect: bool,
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
        asyncio.run(
            watch_events(
                target,
                snapshot=snapshot,
                start_seq=from_seq,
                group_idxs=group_idxs,
                token=token,
                credentials=credentials,
                reconnect=reconnect,
            )
        )
    except KeyboardInterrupt:
        pass
    except KVServiceError as e:
        click.echo(f"# {e.message}", err=True)
        sys.exit(1)


@main.command()
@_log_level_option
@click.option(
    "--trace", type=click.Path(exists=True, dir_okay=False), help="Trace file [the embedded Mooncake sample]."
)
@click.option(
    "--format",
    "trace_format",
    type=click.Choice(["auto", "mooncake", "azure", "tokens"]),
    default="auto",
    show_default=True,
    help="Trace format.",
)
@click.option("--limit", type=click.IntRange(min=1), help="Replay only the first N requests (N >= 1).")
@click.option("--target", help="An existing server HOST:PORT (its prefix cache is reset before each mode).")
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    default="llama-3-8b",
    show_default=True,
    help="Embedded server's model KV layout.",
)
@click.option(
    "--model-config",
    type=click.Path(exists=True),
    help="A Hugging Face config.json (or its folder): the embedded server's KV layout, as serve --model-config [--preset].",
)
@click.option("--block-size", type=int, help="Embedded server's block size in tokens [16].")
@click.option(
    "--num-blocks",
    type=int,
    default=32768,
    show_default=True,
    help="Embedded server's pool, in blocks (--scheduler vllm-tier: 262,144 chunks unless given).",
)
@click.option(
    "--kv-cache-memory",
    help="Size the embedded server's pool from a KV cache budget instead, e.g. 64GiB (vLLM's sizing).",
)
@click.option(
    "--device",
    help="Embedded server's KV tensors: meta (shapes only), cpu, cuda[:N] [meta; cpu with --kv-data shm|grpc].",
)
@click.option(
    "--kv-data",
    type=click.Choice(["shm", "grpc", "off"]),
    help="A worker writes every newly computed block (shm: through the attached memory; grpc: WriteBlocks) and checks every hit's blocks at admission [shm when the device has memory, off on meta].",
)
@click.option(
    "--kv-data-sample",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Move and check only blocks whose hash is 0 mod N (the same blocks every time: a hash decides).",
)
@click.option(
    "--kv-data-lag",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="The worker writes a step's blocks N steps later, as an asynchronous worker can: hits come before their bytes (the server refuses those reads) and requests are freed before theirs are written.",
)
@click.option(
    "--report-mode",
    type=click.Choice(["incremental", "full", "both"]),
    help="kv_cache_report_mode to replay (both: two fresh servers, same trace) [both; full with --instances].",
)
@click.option(
    "--watchers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Watchers per mode (each mirrors and predicts).",
)
@click.option(
    "--late-watcher/--no-late-watcher",
    default=True,
    show_default=True,
    help="Add a watcher that joins halfway through from a snapshot.",
)
@click.option(
    "--mirror-capacity",
    type=click.IntRange(min=0),
    help="Watcher mirror size in blocks (0: unbounded) [half the pool].",
)
@click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=32, show_default=True, help="Most running requests."
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=8192,
    show_default=True,
    help="Token budget per step.",
)
@click.option(
    "--step-ms",
    type=float,
    default=20.0,
    show_default=True,
    help="Simulated milliseconds per step (> 0).",
    callback=lambda ctx, param, v: _positive_finite(param, v),
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="kvservice-replay",
    show_default=True,
    help="Where report.json and agreement.png go.",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="A progress bar, or a plain line every 10 s [a bar when stdout is a terminal, plain lines otherwise].",
)
# -- multi-instance routing option --
@click.option(
    "--instances",
    type=click.IntRange(min=1, max=64),
    default=1,
    show_default=True,
    help="N >= 2: route over N embedded servers of --num-blocks each by the mirrors' predicted hit, against round-robin; writes routing.json.",
)
@click.option(
    "--rate-scale", type=float, help="With --instances: arrival-rate multiplier (arrival times divided by it) [N]."
)
@click.option(
    "--nats-url",
    help="With --instances: every server publishes to this NATS JetStream (a stream per policy run, deleted after) and the router's mirrors are fed over it, not over gRPC StreamEvents.",
)
@click.option(
    "--scheduler",
    type=click.Choice(["kvservice", "vllm", "vllm-async", "vllm-tier"]),
    default="kvservice",
    show_default=True,
    help="vllm / vllm-async: vLLM 0.33's own Scheduler / AsyncScheduler over the trace, in process and on an embedded kvservice, compared step by step; vllm-tier: two vLLM schedulers, each with an OffloadingConnector on the kvservice tier, share prefix chunks through one embedded server, bytes checked (first 400 requests unless --limit; tier-report.json). Both need kvservice-vllm: bash scripts/setup_vllm.sh.",
)
def replay(**options: Any) -> None:
    """Replay a serving trace through the service and report hits and watcher agreement."""
    if options["scheduler"] == "vllm-tier":
        _replay_vllm_tier(options)
        return
    if options["scheduler"] != "kvservice":
        _replay_vllm(options)
        return
    _check_replay_options(options)
    outputs = ("routing.json", "routing.png") if options["instances"] >= 2 else ("report.json", "agreement.png")
    _check_replay_out_dir(options["out_dir"], outputs)
    click.echo(_replay_first_line(options, _target_layout(options["target"]) if options["target"] else None))
    # The process ends after the replay. The interpreter's last collections, as it tears the
    # modules down, would traverse every object the replay made (0.1-0.3 s) for memory the OS takes
    # back anyway; frozen objects are skipped. atexit: in a process that goes on (a test), only
    # at its end; once however many replays it runs.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    if options["instances"] >= 2:
        if options["kv_data"] not in (None, "off"):
            raise click.UsageError("--kv-data runs with one instance (leave out --instances)")
        _replay_instances(options)
        return

    # The plot renders in a process of its own, started now so matplotlib loads while the replay
    # runs (kvservice.replay.plot_process); with one core nothing would overlap.
    from kvservice.replay.plot_process import PlotProcess

    with PlotProcess(enabled=(os.cpu_count() or 1) > 1) as plots:
        _replay_one_instance(options, plots)


def _replay_vllm(options: dict[str, Any]) -> None:
    """``replay --scheduler vllm``: vLLM's scheduler in process and on kvservice
    (``kvservice.replay.vllm_mode``); its table, and ``vllm-report.json`` in ``--out``."""
    from rich.console import Console

    from kvservice.replay.vllm_mode import render, run_vllm_replay

    if options["target"] is not None or options["instances"] >= 2:
        raise click.UsageError("--scheduler vllm runs its own embedded server: leave out --target and --instances")
    limit = options["limit"]
    first = f", first {limit} requests" if limit else ""
    click.echo(
        f"kvservice replay --scheduler {options['scheduler']}: {options['trace'] or 'the Mooncake sample'}{first}; "
        f"{options['num_blocks']:,} blocks of {options['block_size'] or 16} tokens"
    )
    try:
        report = run_vllm_replay(
            trace=options["trace"],
            limit=options["limit"],
            num_blocks=options["num_blocks"],
            block_size=options["block_size"] or 16,
            max_model_len=131072,
            async_scheduling=options["scheduler"] == "vllm-async",
            out_dir=options["out_dir"],
        )
    except ModuleNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    Console().print(render(report))
    if not report.same_decisions:
        raise click.ClickException(f"the two runs decided differently from step {report.first_difference_step} on")


_TIER_REPLAY_OPTIONS = ("trace", "limit", "num_blocks", "step_ms", "max_num_batched_tokens", "out_dir", "log_level")
"""``replay`` options ``--scheduler vllm-tier`` reads (and ``scheduler`` itself); it refuses others given."""


def _replay_vllm_tier(options: dict[str, Any]) -> None:
    """``replay --scheduler vllm-tier``: two vLLM schedulers sharing one kvservice tier
    (``kvservice.replay.vllm_mode.run_vllm_tier_replay``); its table, and ``tier-report.json`` in
    ``--out``.

    Raises:
        click.UsageError: an option this mode does not read was given, or a trace format other
            than Mooncake's.
        click.ClickException: kvservice-vllm is missing, or a chunk's bytes differed.
    """
    from click.core import ParameterSource

    from kvservice.replay.vllm_mode import TIER_DEFAULT_LIMIT, TIER_DEFAULT_SERVER_BLOCKS

    ctx = click.get_current_context()
    given = [
        name
        for name in options
        if name not in (*_TIER_REPLAY_OPTIONS, "scheduler", "trace_format")
        and ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
    ]
    if options["trace_format"] not in ("auto", "mooncake"):
        given.append("format")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in sorted(given))
        raise click.UsageError(
            f"--scheduler vllm-tier runs its own server and model (Mooncake traces, 16-token blocks): leave out {flags}"
        )
    limit = options["limit"] or TIER_DEFAULT_LIMIT
    explicit_blocks = ctx.get_parameter_source("num_blocks") not in (ParameterSource.DEFAULT, None)
    num_server_blocks = options["num_blocks"] if explicit_blocks else TIER_DEFAULT_SERVER_BLOCKS
    click.echo(
        f"kvservice replay --scheduler vllm-tier: {options['trace'] or 'the Mooncake sample'}, first {limit:,} "
        f"requests; 2 vLLM schedulers, one kvservice tier of {num_server_blocks:,} chunks"
    )
    from kvservice.replay.vllm_mode import render_tier, run_vllm_tier_replay

    try:
        result = run_vllm_tier_replay(
            trace=options["trace"],
            limit=limit,
            num_server_blocks=num_server_blocks,
            step_ms=options["step_ms"],
            max_num_batched_tokens=options["max_num_batched_tokens"],
            out_dir=options["out_dir"],
        )
    except ModuleNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(render_tier(result), nl=False)
    click.echo(f"report: {os.path.join(options['out_dir'], 'tier-report.json')}")
    mismatches = sum(s.mismatches + s.gpu_load_mismatches for s in result.instances)
    if mismatches:
        raise click.ClickException(f"{mismatches:,} chunks differed from the bytes their block hash names")


def _replay_one_instance(options: dict[str, Any], plots: PlotProcess) -> None:
    """``replay`` without ``--instances``: the report modes on embedded servers (or ``--target``);
    the table, the JSON and the agreement plot (rendered by ``plots``, a
    :class:`~kvservice.replay.plot_process.PlotProcess`)."""
    from pathlib import Path

    from kvservice.replay.report import render_table, write_json
    from kvservice.replay.runner import ReplayConfig, run_replay
    from kvservice.replay.scheduler import SchedulerConfig

    modes = ("incremental", "full") if options["report_mode"] in (None, "both") else (options["report_mode"],)
    device, kv_data = options["device"], options["kv_data"]
    if device is None:
        device = "cpu" if kv_data in ("shm", "grpc") else "meta"
    if kv_data is None:
        kv_data = "off" if device == "meta" else "shm"
    if kv_data != "off" and device == "meta":
        raise click.UsageError(f"--kv-data {kv_data} needs memory behind the KV tensors: --device cpu (or cuda)")
    config = ReplayConfig(
        trace=options["trace"],
        trace_format=options["trace_format"],
        limit=options["limit"],
        target=options["target"],
        preset=options["preset"],
        model_config=options["model_config"],
        block_size=options["block_size"],
        num_blocks=options["num_blocks"],
        device=device,
        kv_data=kv_data,
        kv_data_sample=options["kv_data_sample"],
        kv_data_lag=options["kv_data_lag"],
        kv_cache_memory=_parse_kv_cache_memory(options["kv_cache_memory"]),
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
    try:  # checked before the run (_check_replay_out_dir); this catches what changed since
        json_path = write_json(report, out / "report.json")
    except OSError as e:
        raise click.ClickException(f"cannot write {out / 'report.json'}: {e.strerror or e}") from None
    plots.submit(json_path, out / "agreement.png")  # drawn while the table is printed
    click.echo(render_table(report))
    try:
        png_path = plots.result()
    except OSError as e:
        raise click.ClickException(
            f"wrote {json_path}; cannot write {out / 'agreement.png'}: {e.strerror or e}"
        ) from None
    click.echo(f"wrote {json_path} and {png_path}")


def _check_replay_out_dir(out_dir: str, outputs: tuple[str, ...]) -> None:
    """Makes ``out_dir`` and checks the replay can write each of ``outputs`` in it, before the run:
    an output it cannot write (a directory in its place, a read-only or missing parent) is a
    usage error naming --out and the path, not a traceback after the whole run.

    Raises:
        click.BadParameter: ``out_dir`` cannot be made or written, or an output is a directory.
    """
    import tempfile
    from pathlib import Path

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise click.BadParameter(f"cannot write in {out}: {e.strerror or e}", param_hint="'--out'") from None
    for name in outputs:
        path = out / name
        if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
            raise click.BadParameter(f"cannot write {path} (a directory or read-only)", param_hint="'--out'")


def _check_replay_options(options: dict[str, Any]) -> None:
    """Every check that can be made before anything starts (the embedded servers' settings and
    bounds included), so a bad option fails at once, not after the first mode ran."""
    from kvservice.server.settings import CacheSettings, LimitsSettings

    if options["nats_url"] is not None and options["instances"] < 2:
        raise click.UsageError("--nats-url feeds the router's mirrors of --instances N (N >= 2)")
    if options["instances"] >= 2:
        if options["target"] is not None:
            raise click.UsageError("--instances runs its own servers; it cannot use --target")
        if options["report_mode"] == "both":
            raise click.UsageError("--instances compares routing in one report mode: choose incremental or full")
        if options["kv_cache_memory"] is not None:
            raise click.UsageError(
                "--kv-cache-memory sizes the one embedded server; give --num-blocks with --instances"
            )
    if options["target"] is not None and options["model_config"] is not None:
        raise click.UsageError("--model-config sets the embedded server's layout; --target has its own")
    if options["target"] is None:
        try:
            CacheSettings(
                preset=options["preset"],
                model_config=options["model_config"],
                block_size=options["block_size"],
                num_blocks=options["num_blocks"],
                device=options["device"] or "meta",
            )
        except ValueError as e:
            raise click.UsageError(f"the embedded server: {e}") from None
        max_step_tokens = LimitsSettings().max_step_tokens
        if options["max_num_batched_tokens"] > max_step_tokens:
            raise click.BadParameter(
                f"{options['max_num_batched_tokens']} is above the embedded server's max_step_tokens "
                f"({max_step_tokens} tokens per Step)",
                param_hint="'--max-num-batched-tokens'",
            )
        pool = options["num_blocks"] - 1
        if options["mirror_capacity"] is not None and options["mirror_capacity"] > pool:
            raise click.BadParameter(
                f"{options['mirror_capacity']} is above the pool ({pool} blocks; 0: unbounded)",
                param_hint="'--mirror-capacity'",
            )


def _replay_first_line(options: dict[str, Any], target_layout: str | None = None) -> str:
    """What the replay is about to do, printed before anything heavy is imported or started
    (``target_layout``: what ``--target`` holds, :func:`_target_layout`). Pools are counted in
    ``num_blocks``, block 0 (the null block) included, as the table counts them."""
    trace = options["trace"] or "the embedded Mooncake sample"
    limit = f", first {options['limit']} requests" if options["limit"] else ""
    if options["block_size"]:
        block_size = options["block_size"]
    elif options["model_config"]:
        from kvservice.core.model_config import DEFAULT_BLOCK_SIZE

        block_size = DEFAULT_BLOCK_SIZE
    else:
        block_size = PRESETS[options["preset"]].default_block_size
    pool = options["num_blocks"] - 1  # the mirror's default is half the blocks a request can get
    mirror = options["mirror_capacity"]
    if mirror == 0:
        mirror_text = "unbounded"
    elif mirror is None and options["target"]:
        mirror_text = "half the server's pool"
    else:
        mirror_text = f"{(pool // 2 if mirror is None else mirror):,} blocks"
    if options["instances"] >= 2:
        what = (
            f"{options['instances']} instances, routed vs round-robin, report mode {options['report_mode'] or 'full'}"
        )
    else:
        what = f"report mode {'incremental and full' if options['report_mode'] in (None, 'both') else options['report_mode']}"
    layout = f"model config {options['model_config']}" if options["model_config"] else f"preset {options['preset']}"
    if options["target"]:
        where = f"server {options['target']} ({target_layout or 'layout unknown'})"
        layout = ""
    elif options["kv_cache_memory"] is not None:
        where = f"pool sized from a {options['kv_cache_memory']} KV cache budget, blocks of {block_size} tokens"
    else:
        where = f"pool {options['num_blocks']:,} blocks of {block_size} tokens"
    return (
        f"replay: {trace}{limit}; {layout + ', ' if layout else ''}{where}, mirror {mirror_text}; {what}; "
        f"{options['watchers']} watcher(s){' + a late one' if options['late_watcher'] else ''}"
    )


def _target_layout(target: str) -> str:
    """What ``--target`` holds, from its GetKVCacheGroupMetadata: "preset P, N blocks of B tokens"
    (and the number of KV cache groups when more than one).

    Raises:
        click.ClickException: the target does not answer (its address and the status named).
    """
    from kvservice_client.client import KVCacheClient, KVServiceError

    try:
        with KVCacheClient(target, timeout=10.0) as client:
            metadata = client.get_kv_cache_group_metadata()
    except KVServiceError as e:
        raise click.ClickException(f"{target}: {e.code.name}: {e.message}") from None
    group = metadata.groups[0]
    groups = f", {len(metadata.groups)} KV cache groups" if len(metadata.groups) > 1 else ""
    return f"preset {metadata.preset}, {group.num_blocks:,} blocks of {group.block_size} tokens{groups}"


def _parse_kv_cache_memory(value: str | None) -> int | None:
    """``--kv-cache-memory`` in bytes (None: not given)."""
    if value is None:
        return None
    from kvservice.server.app import parse_bytes

    try:
        return parse_bytes(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--kv-cache-memory") from None


def _replay_instances(options: dict[str, Any]) -> None:
    """``replay --instances N`` (N >= 2): routed against round-robin (kvservice.replay.multi)."""
    from pathlib import Path

    from kvservice.replay.multi import MultiReplayConfig, run_multi_replay
    from kvservice.replay.multi_report import render_multi_table, write_multi_json
    from kvservice.replay.scheduler import SchedulerConfig
    from kvservice_client.client import KVServiceError

    try:
        config = MultiReplayConfig(
            trace=options["trace"],
            trace_format=options["trace_format"],
            limit=options["limit"],
            instances=options["instances"],
            preset=options["preset"],
            model_config=options["model_config"],
            block_size=options["block_size"],
            num_blocks=options["num_blocks"],
            rate_scale=options["rate_scale"],
            device=options["device"] or "meta",
            report_mode=options["report_mode"] or "full",
            mirror_capacity=options["mirror_capacity"],
            scheduler=SchedulerConfig(
                max_num_seqs=options["max_num_seqs"],
                max_num_batched_tokens=options["max_num_batched_tokens"],
                step_ms=options["step_ms"],
            ),
            show_progress=options["progress"],
            nats_url=options["nats_url"],
        )
        report = asyncio.run(run_multi_replay(config))
    except KVServiceError as e:
        raise click.ClickException(f"an embedded server: {e.code.name}: {e.message}") from None
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    from kvservice.replay.routing_plot import plot_routing

    json_path = write_multi_json(report, Path(options["out_dir"]) / "routing.json")
    png_path = plot_routing(report, Path(options["out_dir"]) / "routing.png")
    click.echo(render_multi_table(report))
    click.echo(f"wrote {json_path} and {png_path}")


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
