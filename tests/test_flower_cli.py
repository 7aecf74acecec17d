"""``pflkit flower``: the app project, certificates, keys, bad input, and pflkit without Flower."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from pflkit.flower.local import app_pyproject, split_clients
from test_cli import cfg_file, pflkit  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]


def test_committed_flower_app_is_what_pflkit_writes(tmp_path):
    assert (REPO / "flower-app" / "pyproject.toml").read_text() == app_pyproject()
    r = pflkit("flower", "app", "myapp", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "myapp" / "pyproject.toml").read_text()
    assert 'serverapp = "pflkit.flower.apps:serverapp"' in text
    assert 'clientapp = "pflkit.flower.apps:clientapp"' in text


def test_certificates_chain_to_the_ca_and_name_the_hosts(tmp_path):
    r = pflkit(
        "flower", "certs", "certs", "--host", "link.example", "--host", "10.0.0.5", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    ca = x509.load_pem_x509_certificate((tmp_path / "certs" / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "certs" / "server.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["link.example"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert (tmp_path / "certs" / "server.key").stat().st_mode & 0o077 == 0


def test_node_key_is_an_openssh_ec_key_pair(tmp_path):
    from cryptography.hazmat.primitives.serialization import (
        load_ssh_private_key,
        load_ssh_public_key,
    )

    r = pflkit("flower", "node-key", "keys", "node7", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    private = load_ssh_private_key((tmp_path / "keys" / "node7").read_bytes(), None)
    public = load_ssh_public_key((tmp_path / "keys" / "node7.pub").read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert private.public_key().public_numbers() == public.public_numbers()


def test_split_clients_into_contiguous_ranges():
    assert split_clients(3, 3) == ["0", "1", "2"]
    assert split_clients(10, 3) == ["0-2", "3-6", "7-9"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["local", "CFG", "--nodes", "9"],
            "--nodes 9 must be between 1 and the config's 4 clients",
        ),
        (["local", "CFG", "--set", "algorithm.name=fedavgx"], "fedavgx"),
        (
            ["local", "CFG", "--round-timeout", "-1"],
            "--round-timeout -1.0 is not a number of seconds",
        ),
        (["run", "CFG", "--insecure"], "--superlink '' is not host:port"),
        *[
            (
                ["run", "CFG", "--insecure", "--superlink", bad],
                f"--superlink '{bad}' is not host:port",
            )
            for bad in (":abc", ":99999", ":0", "127.0.0.1:", "127.0.0.1:65536", "h:-1")
        ],
        (["run", "CFG", "--superlink", "h:1"], "exactly one of --root-certificates"),
        (
            ["run", "CFG", "--superlink", "h:1", "--root-certificates", "no.pem"],
            "'no.pem' does not exist",
        ),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(cli, args, message, cfg_file, tmp_path):  # noqa: F811
    args = [str(cfg_file) if a == "CFG" else a for a in args]
    r = cli("flower", *args, "--out", "out", cwd=tmp_path)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_pflkit_imports_and_explains_when_flower_is_missing(cfg_file, tmp_path):  # noqa: F811
    code = (
        "import sys; sys.modules['flwr'] = None\n"  # an import of flwr now fails
        "import pflkit, pflkit.engine, pflkit.algorithms\n"
        "from pflkit.cli import main\n"
        f"sys.argv = ['pflkit', 'flower', 'local', {str(cfg_file)!r}]\n"
        "main()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "Flower is not installed: pip install 'pflkit[flower]'" in r.stderr


def test_a_failed_flower_local_leaves_no_temporary_folder(cfg_file, tmp_path, monkeypatch):  # noqa: F811
    import tempfile

    from pflkit import cli
    from pflkit.errors import PflkitError
    from pflkit.flower import local

    def fails(self):
        (self.workdir / "superlink.log").write_text("boom\n")
        raise PflkitError("flower-superlink exited with code 1 on start")

    monkeypatch.setattr(local.Federation, "__enter__", fails)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pflkit", "flower", "local", str(cfg_file), "-o", "out"])
    with pytest.raises(SystemExit) as err:
        cli.main()
    assert err.value.code == 2
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_process_that_dies_on_start_is_named_with_its_last_log_line(tmp_path):
    from pflkit.errors import PflkitError
    from pflkit.flower.local import free_port, wait_for_port

    log = tmp_path / "superlink.log"
    with open(log, "wb") as f:
        code = "print('starting'); print('Address already in use'); raise SystemExit(3)"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=f)
    proc.wait()
    with pytest.raises(PflkitError) as err:
        wait_for_port(free_port(), 10, "flower-superlink", proc, log)
    assert str(err.value) == (
        "flower-superlink exited with code 3 on start; the end of its log: Address already in use"
    )
