"""Who may use a storage server: the token (--token-file) and mutual TLS (--tls-cert, --tls-key,
--client-ca), and the rule that a server off loopback speaks TLS unless told --insecure."""
from __future__ import annotations

import hmac
import ipaddress
import os
import ssl
import stat
from pathlib import Path


class SecurityError(ValueError):
    """A server configuration that would let someone in unchecked, or a credential file that
    cannot be used: refused before the server listens."""


# A token shorter than this is guessable over a network (bytes of text, after stripping).
MIN_TOKEN_BYTES = 16


def load_token(path: str | os.PathLike[str]) -> bytes:
    """The token in `path`: one word of at least MIN_TOKEN_BYTES, in a regular file that not
    every user may read (the token is a password)."""
    file = Path(path)
    try:
        info = file.stat()
        text = file.read_bytes()
    except OSError as exc:
        raise SecurityError(f"token file {file}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise SecurityError(f"token file {file} is not a regular file")
    if info.st_mode & stat.S_IROTH:
        raise SecurityError(f"token file {file} is readable by every user (chmod 600 {file})")
    token = text.strip()
    if len(token) < MIN_TOKEN_BYTES or len(token.split()) != 1:
        raise SecurityError(f"token file {file} must hold one word of at least {MIN_TOKEN_BYTES} characters "
                            "(e.g. `openssl rand -hex 32 > FILE`)")
    return token


def token_matches(offered: bytes | memoryview, expected: bytes) -> bool:
    """Constant-time comparison: how long it takes says nothing of how much matched."""
    return hmac.compare_digest(bytes(offered).strip(), expected)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this node only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_tls_context(cert: str | os.PathLike[str], key: str | os.PathLike[str],
                       client_ca: str | os.PathLike[str] | None) -> ssl.SSLContext:
    """TLS 1.2+ with the server's certificate; with `client_ca`, every client must present a
    certificate that CA signed (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
        if client_ca is not None:
            context.load_verify_locations(cafile=str(client_ca))
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise SecurityError(f"TLS setup: {exc}") from None
    return context


def check_listen(host: str, *, tls: bool, token: bool, client_ca: bool, insecure: bool) -> None:
    """Refuse a configuration that serves unchecked: no token and no client certificates
    (anyone who can connect could train or delete), or plain TCP off loopback (the token
    and every gradient in clear on the network), unless `insecure`."""
    if insecure:
        return
    if not token and not client_ca:
        raise SecurityError("no --token-file and no --client-ca: every client would be let in unchecked "
                            "(pass --insecure to allow that)")
    if not tls and not is_loopback(host):
        raise SecurityError(f"refusing to listen on {host} without TLS: tokens and tensors would cross the "
                            "network in clear (give --tls-cert and --tls-key, or pass --insecure)")
