"""TLS downgrade and mutual-TLS misuse against a real `cossd serve --tls-cert ... --client-ca ...`: each attempt
fails at once with a line that says why on the client, a refusal in the server's log, no plaintext fallback."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

import pytest

from cossd.client import AdminClient, RemoteTransport
from test_server import Served, serve, token_file  # noqa: F401 (fixtures)
from waiting import wait_until

pytestmark = pytest.mark.mount

TIMEOUT_S = 5.0

_CA_CONFIG = """[ca]
default_ca = test
[test]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = any
copy_extensions = none
[any]
commonName = supplied
[server]
subjectAltName = IP:127.0.0.1
"""


def _pki(directory: Path) -> dict[str, Path]:
    """Two CAs (the server's and a stranger's), the server's certificate for 127.0.0.1, one
    already expired, one for another host, and a client certificate from each CA."""
    directory.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "rogue-ca"):
        openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}")
    (directory / "ca.cnf").write_text(_CA_CONFIG)
    (directory / "index.txt").write_text("")
    (directory / "serial").write_text("01\n")
    (directory / "other-host.ext").write_text("subjectAltName=DNS:storage.elsewhere.example,IP:10.9.9.9\n")
    (directory / "here.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ca, extension in (("server", "ca", "here.ext"), ("other-host", "ca", "other-host.ext"),
                                ("client", "ca", None), ("rogue-client", "rogue-ca", None)):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *(["-extfile", extension] if extension else []))
    # Valid for 127.0.0.1, signed by the right CA, but over since 2020.
    openssl("req", *ec, "-keyout", "expired.key", "-out", "expired.csr", "-subj", "/CN=expired")
    openssl("ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key", "-in", "expired.csr",
            "-out", "expired.pem", "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
            "-extensions", "server", "-notext")
    return {path.name: path for path in directory.iterdir()}


def _refusals(served: Served) -> list[str]:
    return [line for line in served.log().splitlines() if "refused " in line]


def _refused_once_more(served: Served, before: int, *words: str) -> str:
    """The server's log gains exactly one refusal, saying `words`; returns it."""
    wait_until(lambda: len(_refusals(served)) > before, 10)
    lines = _refusals(served)
    assert len(lines) == before + 1, lines
    assert all(word in lines[-1] for word in words), lines[-1]
    return lines[-1]


def _fails(attempt: Callable[[], object], kind: type[BaseException], *words: str) -> str:
    with pytest.raises(kind) as failed:
        attempt()
    message = str(failed.value)
    assert all(word in message for word in words) and "\n" not in message, message
    return message


def test_tls_misuse_fails_cleanly_on_both_sides(serve: Callable[..., Served], token_file: Path,  # noqa: F811
                                                tmp_path: Path) -> None:
    pki = _pki(tmp_path / "pki")
    mutual = serve("--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"]),
                   "--client-ca", str(pki["ca.pem"]), name="mtls")
    ca, cert, key = pki["ca.pem"], pki["client.pem"], pki["client.key"]

    def connect(served: Served, **credentials: object) -> None:
        RemoteTransport(served.url, TIMEOUT_S, token_file=token_file, **credentials).close()  # type: ignore[arg-type]

    with AdminClient(RemoteTransport(mutual.url, TIMEOUT_S, token_file=token_file, ca=ca, cert=cert,
                                     key=key)) as owner:
        owner.create_namespace({"name": "keep", "tensors": [["x", 100]]})
        before_state = owner.describe()["namespaces"]
        seen = len(_refusals(mutual))

        # A plaintext client to the TLS server: refused, told to give the CA.
        _fails(lambda: connect(mutual), ConnectionRefusedError, "TLS server", "ca")
        _refused_once_more(mutual, seen, "TLS")
        # No client certificate where the server requires one.
        _fails(lambda: connect(mutual, ca=ca), PermissionError, "TLS refused", "client certificate")
        _refused_once_more(mutual, seen + 1, "TLS")
        # A client certificate from another CA.
        _fails(lambda: connect(mutual, ca=ca, cert=pki["rogue-client.pem"], key=pki["rogue-client.key"]),
               PermissionError, "TLS refused", "client certificate")
        _refused_once_more(mutual, seen + 2, "TLS")
        assert owner.describe()["namespaces"] == before_state  # nothing reached the device

    # The server's own certificate expired, or made out to another host: the client refuses it.
    for name, reason in (("expired", "expired"), ("other-host", "mismatch")):
        impostor = serve("--tls-cert", str(pki[f"{name}.pem"]), "--tls-key", str(pki[f"{name}.key"]),
                         "--client-ca", str(pki["ca.pem"]), name=name)
        _fails(lambda: connect(impostor, ca=ca, cert=cert, key=key), PermissionError, "TLS refused", reason)
        _refused_once_more(impostor, 0, "TLS")
        impostor.stop()

    # A TLS client to a plaintext server: refused, never sent in clear.
    plain = serve(name="plain")
    _fails(lambda: connect(plain, ca=ca, cert=cert, key=key), PermissionError, "does not speak TLS")
    _refused_once_more(plain, 0)
    assert " connected" not in plain.log()  # no CONNECT, so no token, went over plain TCP
