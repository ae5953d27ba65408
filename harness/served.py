"""A device served by `cossd serve` on loopback for the demo and the bench: started with a token of its own, killed, restarted on the same port, stopped."""
from __future__ import annotations

import argparse
import ast
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

from ..server import command


def write_token(path: Path) -> Path:
    """A fresh random token in a file only its owner reads (the server refuses any other)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as stream:
        stream.write(secrets.token_hex(32) + "\n")
    return path


class ServedDevice:
    """The storage server of one backing directory, a process of its own (as on a storage
    node): `url` and `token_file` are what a client needs. `crash()` is kill -9; `restart()`
    serves the same backing at the same URL again, as an operator restarting it would."""

    def __init__(self, backing: Path, token_file: Path, *, host: str = "127.0.0.1", port: int = 0,
                 extra: tuple[str, ...] = ()) -> None:
        self.backing, self.token_file, self.extra = backing, token_file, extra
        self.host = host
        self.pid, self.url = self._start(port)
        self.stopped: dict[str, Any] | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def _start(self, port: int) -> tuple[int, str]:
        parser = argparse.ArgumentParser()
        command.add_serve_arguments(parser)
        args = parser.parse_args([str(self.backing), "--listen", f"{self.host}:{port}",
                                  "--token-file", str(self.token_file), *self.extra])
        return command.start_background(args)

    def _wait_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if os.waitpid(self.pid, os.WNOHANG)[0] == self.pid:
                    return True
            except ChildProcessError:  # not our child (started by another process): look
                if not Path(f"/proc/{self.pid}").exists():
                    return True
            time.sleep(0.02)
        return False

    def crash(self) -> None:
        """kill -9: no flush, no goodbye to the clients (their calls fail with ECONNABORTED)."""
        os.kill(self.pid, signal.SIGKILL)
        self._wait_gone(30)

    def restart(self) -> None:
        self.pid, self.url = self._start(self.port)

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """SIGTERM, wait for the exit; the server's own counters ("stopped: {...}" in its log)."""
        if self.stopped is not None:
            return self.stopped
        try:
            os.kill(self.pid, signal.SIGTERM)
            os.kill(self.pid, signal.SIGCONT)  # a stopped server (SIGSTOP) gets the SIGTERM only once continued
        except ProcessLookupError:
            pass
        if not self._wait_gone(timeout_s):
            os.kill(self.pid, signal.SIGKILL)
            self._wait_gone(30)
        log = self.backing / "server.log"
        self.stopped = {}
        for line in reversed(log.read_text(errors="replace").splitlines() if log.exists() else []):
            if "stopped: {" in line:
                self.stopped = ast.literal_eval(line.split("stopped: ", 1)[1])
                break
        return self.stopped
