"""Start a Flower SuperLink and SuperNodes on this machine, run a pflkit config on them, stop
them: the try-out path of ``pflkit flower local`` and of the end-to-end tests. Also the pieces
of a real deployment: the Flower app project, TLS certificates, SuperNode keys, and a
``flwr run`` against any SuperLink (``pflkit flower run``).

Every process is started in its own session and stopped by PID (SIGTERM to its process group,
then SIGKILL after a grace period), together with the process groups its descendants opened
(the SuperLink starts its SuperExec in a new session). Telemetry, update checks and runtime
dependency installation are switched off; ``FLWR_HOME`` is a folder of the federation's own,
so nothing is written to ``~/.flwr``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from pflkit.engine.folder import make_folder
from pflkit.errors import PflkitError
from pflkit.flower.watchdog import alive, groups_below, process_table

APP_NAME = "pflkit-app"
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "PYTHONUNBUFFERED": "1",
}


def app_pyproject() -> str:
    """The Flower app project's pyproject.toml (``flower-app/pyproject.toml`` is this text)."""
    return f'''# A Flower app that runs pflkit: its ServerApp and ClientApp come from the installed pflkit
# (pip install "pflkit[flower]" on the SuperLink and on every SuperNode). See docs/flower.md.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{APP_NAME}"
version = "1.0.0"
description = "pflkit algorithms on Flower"
license = "Apache-2.0"
dependencies = ["pflkit[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "pflkit"

[tool.flwr.app.components]
serverapp = "pflkit.flower.apps:serverapp"
clientapp = "pflkit.flower.apps:clientapp"

[tool.flwr.app.config]
config = ""          # the pflkit experiment config as YAML text (pflkit flower fills it in)
out = "runs/flower"  # the run folder, on the SuperLink's machine
node-wait = 60.0     # seconds to wait for SuperNodes covering every client
round-timeout = 0.0  # seconds to wait for a round's replies (0: until each reply or error)
secagg = 0.0         # 1: sum the uploads with Flower's SecAgg+ (docs/flower.md)
secagg-clip = 8.0    # SecAgg+: every summed upload entry lies in [-clip, clip]
secagg-quantization = 4194304.0  # SecAgg+: the integers [-clip, clip] maps onto (2**22)
'''


def write_app(directory: str | Path) -> Path:
    """Write the Flower app project into ``directory`` (created if needed)."""
    d = Path(directory)
    make_folder(d, "folder")
    (d / "pyproject.toml").write_text(app_pyproject())
    return d


def run_config_file(path: Path, config_text: str, out: str | Path, **values: float) -> Path:
    """A TOML file of run-config overrides for ``flwr run --run-config``."""
    lines = [f"config = {json.dumps(config_text)}", f"out = {json.dumps(str(out))}"]
    lines += [f"{k} = {float(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# -- certificates and keys ----------------------------------------------------------------------


def make_certificates(directory: str | Path, hosts: Sequence[str] = ("localhost", "127.0.0.1")):
    """A self-signed CA and a SuperLink certificate for ``hosts`` (names or IPs), as
    ``ca.pem``, ``server.pem``, ``server.key`` in ``directory``; returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    hosts = list(hosts)
    _check_hosts(hosts)
    d = Path(directory)
    make_folder(d, "folder")
    now = dt.datetime.now(dt.UTC)

    def build(subject, issuer, public_key, signer, ca: bool, sans=()):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
            b = b.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
        return b.sign(signer, hashes.SHA256())

    def san(host: str):
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pflkit federation CA")])
    ca = build(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = build(name, ca_name, key.public_key(), ca_key, ca=False, sans=[san(h) for h in hosts])
    pem = serialization.Encoding.PEM
    paths = d / "ca.pem", d / "server.pem", d / "server.key"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[2].chmod(0o600)
    return paths


_DNS_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_DNS_NAME = re.compile(rf"(?:\*\.)?{_DNS_LABEL}(?:\.{_DNS_LABEL})*\.?")


def _check_hosts(hosts: list[str]) -> None:
    """Every certificate host is an IP address or a DNS name (ASCII labels of letters, digits,
    '-' and '_', an optional leading '*.'); the first, the common name, has at most 64
    characters."""
    if not hosts:
        raise PflkitError("give at least one --host: the SuperLink's name or IP address")
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            continue
        except ValueError:
            pass
        if not (isinstance(host, str) and len(host) <= 253 and _DNS_NAME.fullmatch(host)):
            raise PflkitError(
                f"--host {host!r} is not a host name or an IP address: give the name or IP the "
                "SuperNodes use for the SuperLink, e.g. --host superlink.example.org or "
                "--host 10.0.0.5 (non-ASCII names in their xn-- form)"
            )
    if len(hosts[0]) > 64:
        raise PflkitError(
            f"the first --host ({hosts[0][:40]}...) is the certificate's common name, which has "
            "at most 64 characters: give a shorter name or an IP address first"
        )


def make_node_key(directory: str | Path, name: str) -> tuple[Path, Path]:
    """A SuperNode authentication key pair (EC P-384, OpenSSH format): ``name`` (private) and
    ``name.pub`` (register it with ``flwr supernode register``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if name in ("", ".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise PflkitError(
            f"key name {name!r} is not a plain file name: give a name without '/', e.g. "
            "supernode (the folder to write the key pair into is its own argument)"
        )
    d = Path(directory)
    make_folder(d, "folder")
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = d / name, d / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return private, public


# -- processes ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(
    port: int, timeout: float, what: str, proc: subprocess.Popen, log: Path | None = None
) -> None:
    """Wait until ``proc`` listens on ``port``; else one sentence that quotes the last line
    of its ``log`` (a temporary work folder is gone by the time the user reads it)."""

    def last_line() -> str:
        lines = log.read_text(errors="replace").strip().splitlines() if log else []
        return f"; the end of its log: {lines[-1].strip()}" if lines else ": see its log"

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PflkitError(f"{what} exited with code {proc.returncode} on start{last_line()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise PflkitError(f"{what} did not open port {port} within {timeout:.0f} s{last_line()}")


def _reap_orphans(keep: set[int]) -> None:
    """Reap zombies re-parented to this process (see :func:`_become_subreaper`), except the
    processes in ``keep``, which their Popen objects wait for."""
    me = os.getpid()
    for pid, parent, _, zombie in process_table():
        if zombie and parent == me and pid not in keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _become_subreaper() -> None:
    """Adopt orphaned descendants (Linux), so that processes whose SuperNode was killed are
    reaped here instead of lingering as zombies under a container's init."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


@dataclass
class Connection:
    """How ``flwr`` reaches a SuperLink: its own ``FLWR_HOME`` with one connection, so nothing
    is written to ``~/.flwr``. ``root_certificates``: the CA of a TLS SuperLink (None: the
    connection is insecure)."""

    address: str
    home: Path
    root_certificates: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = Path(self.home)
        self.home.mkdir(parents=True, exist_ok=True)
        # Flower's executables (and the ones they start) from this Python's environment first
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        self.env = {
            **os.environ,
            **QUIET_ENV,
            **self.env,
            "FLWR_HOME": str(self.home),
            "PATH": path,
        }
        tls = (
            f"root-certificates = {json.dumps(str(Path(self.root_certificates).resolve()))}"
            if self.root_certificates
            else "insecure = true"
        )
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "pflkit"\n\n[superlink.pflkit]\n'
            f"address = {json.dumps(self.address)}\n{tls}\n"
        )

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.executable("flwr"), *args],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def executable(self, name: str) -> str:
        found = shutil.which(name, path=self.env["PATH"])
        if found is None:
            raise PflkitError(f"'{name}' is not installed: pip install 'pflkit[flower]'")
        return found

    def statuses(self) -> list[str]:
        """The status of each run on the SuperLink, oldest first."""
        listing = self.flwr("ls", "pflkit", "--format", "json")
        try:
            runs = json.loads(listing.stdout)["runs"]
        except (ValueError, KeyError):
            return []
        return [r.get("status", "?") for r in sorted(runs, key=lambda r: r.get("run-id", 0))]

    def run(
        self,
        config_text: str,
        out: str | Path,
        *,
        timeout: float = 3600.0,
        progress: Callable[[dict], None] | None = None,
        echo: bool = False,
        **run_config: float,
    ) -> None:
        """``flwr run`` the pflkit app with ``config_text`` into the run folder ``out`` (a
        path on the SuperLink's machine); wait for it and fail with the log's end when it does
        not complete. ``progress`` is called with each new metrics row when ``out`` is visible
        here (a local federation); ``echo`` prints the streamed ServerApp log instead."""
        work = self.home.parent
        app = write_app(work / "app")
        overrides = run_config_file(work / "run-config.toml", config_text, out, **run_config)
        log_path = work / "flwr-run.log"
        metrics = Path(out) / "metrics.jsonl"
        seen = echoed = 0
        with open(log_path, "w") as log:
            cmd = [self.executable("flwr"), "run", str(app), "pflkit", "--stream"]
            cmd += ["--run-config", str(overrides)]
            proc = subprocess.Popen(
                cmd, env=self.env, cwd=work, stdout=log, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + timeout
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise PflkitError(f"the Flower run did not finish within {timeout:.0f} s")
                if progress and metrics.exists():
                    for line in metrics.read_text().splitlines()[seen:]:
                        if line.endswith("}"):
                            progress(json.loads(line))
                            seen += 1
                if echo:
                    text = log_path.read_text()
                    print(text[echoed:], end="", flush=True)
                    echoed = len(text)
                time.sleep(0.5)
        status = self.statuses()
        # `flwr run` exits 0 even when the ServerApp fails: the run's status tells
        if proc.returncode != 0 or not status or status[-1] != "finished:completed":
            tail = "\n".join(log_path.read_text().strip().splitlines()[-15:])
            raise PflkitError(
                f"the Flower run failed (status {status[-1] if status else 'unknown'}); "
                f"the end of {log_path}:\n{tail}"
            )


@dataclass
class Federation:
    """A SuperLink and SuperNodes on 127.0.0.1, as a context manager that stops everything it
    started on exit. ``nodes``: each SuperNode's ``client-ids`` ("0", "1-3"); ``tls`` makes a
    CA and a certificate; ``auth`` (implies TLS) registers a key per SuperNode."""

    nodes: Sequence[str]
    workdir: Path
    tls: bool = False
    auth: bool = False
    start_timeout: float = 60.0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    watchdog: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.tls = self.tls or self.auth  # Flower refuses SuperNode auth without TLS
        self.port = free_port()

    def __enter__(self) -> Federation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.connection.env,
                cwd=self.workdir,
                start_new_session=True,
            )
        self.procs[name] = proc
        self._watch()
        return proc

    def _watch(self) -> None:
        """List the started processes for the watchdog, and start it once (module
        :mod:`pflkit.flower.watchdog`): it takes them down if this process dies unstopped."""
        roots = self.workdir / "processes.txt"
        roots.write_text(" ".join(str(p.pid) for p in self.procs.values()))
        if self.watchdog is None:
            self.watchdog = subprocess.Popen(
                [sys.executable, "-S", str(Path(__file__).with_name("watchdog.py")),
                 str(os.getpid()), str(roots)],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a signal to our process group must not reach it
            )  # fmt: skip

    def start(self) -> None:
        _become_subreaper()
        self.workdir.mkdir(parents=True, exist_ok=True)
        link, node_tls, ca = ["--insecure"], ["--insecure"], None
        if self.tls:
            ca, cert, key = make_certificates(self.workdir / "certs")
            link = ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert)]
            link += ["--ssl-keyfile", str(key)]
            node_tls = ["--root-certificates", str(ca)]
        # local runs: let SuperExec pick up messages at once (Flower's default polls each 1 s)
        env = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}
        self.connection = Connection(f"127.0.0.1:{self.port}", self.workdir / "flwr-home", ca, env)
        cmd = [
            self.connection.executable("flower-superlink"),
            *link,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        cmd += ["--disable-runtime-dependency-installation"]
        if self.auth:
            cmd.append("--enable-supernode-auth")
        proc = self._start("superlink", cmd)
        wait_for_port(
            self.port, self.start_timeout, "flower-superlink", proc, self.workdir / "superlink.log"
        )
        for i, clients in enumerate(self.nodes):
            cmd = [
                self.connection.executable("flower-supernode"),
                *node_tls,
                "--superlink",
                f"127.0.0.1:{self.port}",
            ]
            port = free_port()
            cmd += ["--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--node-config", f"client-ids={json.dumps(clients)}"]
            if self.auth:
                private, public = make_node_key(self.workdir / "keys", f"node{i}")
                reg = self.connection.flwr("supernode", "register", str(public), "pflkit")
                if reg.returncode != 0:
                    raise PflkitError(f"flwr supernode register failed: {reg.stdout}{reg.stderr}")
                cmd += ["--auth-supernode-private-key", str(private)]
            proc = self._start(f"node{i}", cmd)
            log = self.workdir / f"node{i}.log"
            wait_for_port(port, self.start_timeout, f"flower-supernode {i}", proc, log)

    def run(self, config_text: str, out: str | Path, **kw) -> None:
        """:meth:`Connection.run` on this federation."""
        self.connection.run(config_text, out, **kw)

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode ``i`` and its ClientApp processes (a crash, not a clean exit)."""
        proc = self.procs[f"node{i}"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self, grace: float = 15.0) -> None:
        """Stop every process this federation started, by PID and process group (and the
        groups its descendants opened), SIGTERM first and SIGKILL after ``grace`` seconds."""
        groups = {proc.pid for proc in self.procs.values()}
        for proc in self.procs.values():
            groups |= groups_below(proc.pid)
        for group in groups:
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for group in groups:
            while alive(group) and time.monotonic() < deadline:
                _reap_orphans({p.pid for p in self.procs.values()})
                time.sleep(0.1)
            if alive(group):
                try:
                    os.killpg(group, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.2)
        _reap_orphans({p.pid for p in self.procs.values()})
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()
            self.watchdog = None


def split_clients(num_clients: int, num_nodes: int) -> list[str]:
    """``num_clients`` ids in ``num_nodes`` contiguous ranges ("0-3", "4-6", ...)."""
    if not 1 <= num_nodes <= num_clients:
        raise PflkitError(
            f"--nodes {num_nodes} must be between 1 and the config's {num_clients} clients"
        )
    bounds = [round(i * num_clients / num_nodes) for i in range(num_nodes + 1)]
    return [f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in pairwise(bounds)]
