"""Real git servers on loopback for the tests and the fetch benchmark.

`GitDaemon` serves a directory of bare repositories the way GitHub serves fetches: partial (filter) and
by-SHA wants allowed. `ByteCountingProxy` sits in front of it and counts the bytes that cross the wire,
which is what "fetch transfers only what it needs" is measured by (not what lands on disk).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from tests.processes import live_in_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class GitDaemon:
    def __init__(self, base: Path):
        self.base = base
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                "git",
                "-c",
                "uploadpack.allowFilter=true",
                "-c",
                "uploadpack.allowAnySHA1InWant=true",
                "daemon",
                "--reuseaddr",
                "--export-all",
                "--enable=upload-pack",
                f"--base-path={base}",
                "--listen=127.0.0.1",
                f"--port={self.port}",
                str(base),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for_port(self.port)

    def url(self, name: str, port: int | None = None) -> str:
        return f"git://127.0.0.1:{port or self.port}/{name}"

    def stop(self, timeout: float = 10.0) -> None:
        """End the whole process group: `git daemon` runs `git-daemon` as a child (which forks one more per
        connection), and killing only the `git` wrapper would leave the daemon listening."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + timeout
        while (left := live_in_group(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            raise RuntimeError(
                f"git daemon's process group {self.proc.pid} still runs after SIGKILL: "
                + ", ".join(f"{p.pid} {p.command}" for p in left)
            )


class ByteCountingProxy:
    """A TCP proxy on 127.0.0.1 counting bytes each way; `stall_after` makes it stop forwarding from the
    server after that many bytes (to interrupt a transfer mid-way)."""

    def __init__(self, target_port: int, stall_after: int | None = None):
        self.target_port = target_port
        self.stall_after = stall_after
        self.sent_to_client = 0
        self.sent_to_server = 0
        self.connections = 0  # one per git request (ls-remote, fetch): what "one fetch" is counted by
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.stalled = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self._lock:
            self.sent_to_client = self.sent_to_server = self.connections = 0

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, "sent_to_server"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "sent_to_client"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counter: str) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    if counter == "sent_to_client" and self.stall_after is not None:
                        room = self.stall_after - self.sent_to_client
                        if len(data) >= room:
                            self.stalled.set()  # from here on, swallow: the client waits for bytes that never come
                        data = data[: max(room, 0)]
                    setattr(self, counter, getattr(self, counter) + len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._server.close()


class SilentServer:
    """Accepts connections and never answers: a remote that hangs."""

    def __init__(self):
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._clients: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self._clients.append(self._server.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self._server.close()
        for c in self._clients:
            c.close()
