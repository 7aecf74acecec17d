"""``pflkit flower``: run pflkit on Flower (a local try-out, a SuperLink, the app, TLS
certificates, node keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pflkit.cli.common import _seconds, _show_summary, _usable_path, out_console
from pflkit.cli.options import ConfigArg, ImportOpt, OutOpt, SetOpt
from pflkit.errors import PflkitError
from pflkit.experiment import load_config

# -- Flower --------------------------------------------------------------------------------------

flower = typer.Typer(
    no_args_is_help=True,
    help="Run pflkit on Flower: a local try-out, or a real SuperLink (needs pflkit\\[flower]).",
)


NodeWaitOpt = Annotated[
    float, typer.Option(help="Seconds to wait for SuperNodes covering every client.")
]


RoundTimeoutOpt = Annotated[
    float,
    typer.Option(help="Seconds to wait for a round's replies before failing a client (0: none)."),
]


SecAggOpt = Annotated[
    bool,
    typer.Option(
        help="Secure aggregation: the server sees only the sum of the SuperNodes' uploads "
        "(Flower's SecAgg+; mean-aggregating algorithms only; docs/flower.md)."
    ),
]


SecAggClipOpt = Annotated[
    float | None,
    typer.Option(help="With --secagg: every summed upload entry lies in [-clip, clip] (8)."),
]


SecAggQuantOpt = Annotated[
    int | None,
    typer.Option(help="With --secagg: the integer range [-clip, clip] is mapped onto (2**22)."),
]


def _secagg(cfg, secagg: bool, clip: float | None, quantization: int | None, nodes=None):
    """The run-config keys of secure aggregation, checked (algorithm, options, and with
    ``nodes``, the SuperNodes' client-id specs, every round's spread) before any process
    starts; {} without --secagg."""
    from pflkit.flower import secagg as sa

    if not secagg:
        given = "--secagg-clip" if clip is not None else "--secagg-quantization"
        if clip is not None or quantization is not None:
            raise PflkitError(f"{given} needs --secagg: add --secagg, or leave {given} out")
        return {}
    options = sa.SecAggOptions(
        sa.DEFAULT_CLIP if clip is None else clip,
        sa.DEFAULT_QUANTIZATION if quantization is None else quantization,
    )
    sa.secure_keys(cfg)
    if nodes is not None:
        from pflkit.flower.client import hosted_clients

        node_of = {
            c: i for i, spec in enumerate(nodes) for c in hosted_clients({"client-ids": spec})
        }
        sa.check_rounds(cfg, node_of, options)
    return options.run_config()


def _waits(node_wait: float, round_timeout: float) -> dict[str, float]:
    """The run-config keys of the two waits, checked."""
    for name, value in (("--node-wait", node_wait), ("--round-timeout", round_timeout)):
        _seconds(name, value)
    return {"node-wait": node_wait, "round-timeout": round_timeout}


def _show_row(row: dict) -> None:
    parts = [f"round {row['round']}"]
    for key in ("global_acc", "pers_acc_mean", "pers_acc_selected"):
        if key in row:
            parts.append(f"{key} {100 * row[key]:.2f}%")
    if row.get("failed_clients"):
        parts.append(f"failed clients {row['failed_clients']}")
    out_console.print(", ".join(parts))


@flower.command("local")
def flower_local(
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    out: OutOpt = None,
    nodes: Annotated[
        int, typer.Option(help="SuperNodes to start; clients are split among them.")
    ] = 3,
    tls: Annotated[bool, typer.Option(help="TLS with a fresh self-signed CA.")] = False,
    auth: Annotated[bool, typer.Option(help="SuperNode authentication (implies --tls).")] = False,
    workdir: Annotated[
        Path | None, typer.Option(help="Keep Flower's logs, certificates and keys here.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600.0,
    node_wait: NodeWaitOpt = 60.0,
    round_timeout: RoundTimeoutOpt = 0.0,
    secagg: SecAggOpt = False,
    secagg_clip: SecAggClipOpt = None,
    secagg_quantization: SecAggQuantOpt = None,
) -> None:
    """Try-out on this machine: start a SuperLink and SuperNodes on 127.0.0.1, run CONFIG on
    them through Flower, write the run folder, stop every process."""
    import json
    import shutil
    import tempfile

    from pflkit.engine.folder import make_folder
    from pflkit.engine.runner import new_run_dir
    from pflkit.engine.simulation import Simulation
    from pflkit.flower import require_flower

    require_flower()
    from pflkit.flower.local import Federation, split_clients

    waits = _waits(node_wait, round_timeout)
    _seconds("--timeout", timeout, zero_ok=False)
    if workdir is not None:
        if workdir.exists() and not workdir.is_dir():
            raise PflkitError(
                f"--workdir '{workdir}' is a file, not a folder: choose another --workdir"
            )
        _usable_path(workdir, "Flower work folder", "--workdir")
    cfg = load_config(config, set_ or [], imports)
    run_dir = new_run_dir(cfg, out).resolve()
    spec = split_clients(cfg.data.num_clients, nodes)
    secure = _secagg(cfg, secagg, secagg_clip, secagg_quantization, spec)
    with Simulation(cfg):  # every config, data and model error now, before a process starts
        pass
    if workdir is not None:
        make_folder(workdir, "Flower work folder")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="pflkit-flower-"))
    try:
        with Federation(spec, work, tls=tls, auth=auth) as fed:
            security = "TLS + SuperNode auth" if fed.auth else "TLS" if fed.tls else "insecure"
            where = f"Flower logs in {work}" if workdir else "--workdir DIR keeps Flower's logs"
            out_console.print(
                f"SuperLink 127.0.0.1:{fed.port} ({security}), SuperNodes hosting clients "
                f"{', '.join(spec)}; {where}"
            )
            fed.run(
                cfg.to_yaml(),
                run_dir,
                timeout=timeout,
                progress=_show_row,
                **waits,
                **secure,
            )
    finally:  # a temporary work folder goes, whether the run finished or not
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    _show_summary(run_dir, json.loads((run_dir / "summary.json").read_text()))


@flower.command("run")
def flower_run(
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Run folder, on the SuperLink's machine.")
    ] = Path("runs/flower"),
    superlink: Annotated[str, typer.Option(help="The SuperLink's address, host:port.")] = "",
    root_certificates: Annotated[
        Path | None, typer.Option(help="CA certificate of a TLS SuperLink.")
    ] = None,
    insecure: Annotated[bool, typer.Option(help="Connect without TLS.")] = False,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 86400.0,
    node_wait: NodeWaitOpt = 60.0,
    round_timeout: RoundTimeoutOpt = 0.0,
    secagg: SecAggOpt = False,
    secagg_clip: SecAggClipOpt = None,
    secagg_quantization: SecAggQuantOpt = None,
) -> None:
    """Submit CONFIG to a running SuperLink whose SuperNodes host its clients (see
    docs/flower.md); waits for the run to finish."""
    import shutil
    import tempfile

    from pflkit.flower import require_flower

    require_flower()
    from pflkit.flower.local import Connection

    host, _, port = superlink.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PflkitError(
            f"--superlink '{superlink}' is not host:port with a port from 1 to 65535: e.g. "
            "--superlink 10.0.0.5:9093"
        )
    if insecure == (root_certificates is not None):
        raise PflkitError("give exactly one of --root-certificates CA.pem (TLS) and --insecure")
    if root_certificates is not None and not root_certificates.is_file():
        raise PflkitError(
            f"--root-certificates '{root_certificates}' does not exist: check the path"
        )
    waits = _waits(node_wait, round_timeout)
    _seconds("--timeout", timeout, zero_ok=False)
    cfg = load_config(config, set_ or [], imports)
    secure = _secagg(cfg, secagg, secagg_clip, secagg_quantization)
    home = Path(tempfile.mkdtemp(prefix="pflkit-flwr-"))
    try:
        Connection(superlink, home / "flwr-home", root_certificates).run(
            cfg.to_yaml(),
            out,
            timeout=timeout,
            echo=True,
            **waits,
            **secure,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    out_console.print(f"run completed; run folder on the SuperLink's machine: {out}")


@flower.command("app")
def flower_app(
    directory: Annotated[Path, typer.Argument(help="Folder for the Flower app project.")],
) -> None:
    """Write a Flower app project (pyproject.toml) whose ServerApp and ClientApp are pflkit's."""
    from pflkit.flower.local import write_app

    out_console.print(f"wrote {write_app(directory) / 'pyproject.toml'}")


@flower.command("certs")
def flower_certs(
    directory: Annotated[Path, typer.Argument(help="Folder for ca.pem, server.pem, server.key.")],
    host: Annotated[
        list[str] | None,
        typer.Option(help="Name or IP the SuperNodes use for the SuperLink (repeatable)."),
    ] = None,
) -> None:
    """Make a CA and a SuperLink TLS certificate (self-signed; fine for a private federation)."""
    from pflkit.flower.local import make_certificates

    paths = make_certificates(directory, host or ["localhost", "127.0.0.1"])
    out_console.print("wrote " + ", ".join(str(p) for p in paths))


@flower.command("node-key")
def flower_node_key(
    directory: Annotated[Path, typer.Argument(help="Folder for the key pair.")],
    name: Annotated[str, typer.Argument(help="File name of the private key.")] = "supernode",
) -> None:
    """Make a SuperNode authentication key pair (register the .pub with flwr supernode register)."""
    from pflkit.flower.local import make_node_key

    private, public = make_node_key(directory, name)
    out_console.print(f"wrote {private} and {public}")
