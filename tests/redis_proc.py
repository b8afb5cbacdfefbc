"""A private redis-server that a test can stop and start again under the code it tests (an outage),
with or without persistence (AOF fsynced every second: what an operator restarts; none: a restart
comes back empty)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path


class RedisProcess:
    def __init__(self, port: int, workdir: Path, *, aof: bool) -> None:
        self.port, self.workdir, self.aof = port, workdir, aof
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisProcess:
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: scripts/test.sh installs it")
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.aof else ["--appendonly", "no"]
        self._proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                       *persistence, "--dir", str(self.workdir)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    return self
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: what a crashed node or an OOM kill does (no final save)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=10)
        self._proc = None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        self._proc = None

    def keys(self) -> int:
        import redis

        return int(redis.Redis(host="127.0.0.1", port=self.port).dbsize())
