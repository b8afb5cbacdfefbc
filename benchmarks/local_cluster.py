"""What the serving benchmarks share about the local Ray cluster they start: a free loopback port for
its HTTP server, and its processes by label with their memory and CPU time. Actor pids come from
Ray's GCS actor table, refreshed at each read, so a restarted actor is followed to its new process."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    def __init__(self, actor_labels: Sequence[tuple[str, str]], numbered: Sequence[str] = (),
                 extra: Mapping[str, int] | None = None) -> None:
        """`actor_labels`: (actor class name, label); a label in `numbered` names several actors,
        `label-1`, `label-2`, … in the order they are first seen (stable across reads). `extra`:
        more processes by label (a redis-server). The driver, the GCS and the raylet are always in."""
        import psutil

        self.psutil = psutil
        self.actor_labels = tuple(actor_labels)
        self.numbered = set(numbered)
        self.fixed: dict[str, int] = {"driver": os.getpid(), **(extra or {})}
        for child in psutil.Process().children(recursive=True):  # the local cluster this driver started
            with contextlib.suppress(psutil.Error):
                if child.name() in ("gcs_server", "raylet"):
                    self.fixed[child.name()] = child.pid
        self.numbered_labels: dict[str, str] = {}  # actor name -> its numbered label
        self._handles: dict[int, Any] = {}

    def pids(self) -> dict[str, int]:
        import ray

        out = dict(self.fixed)
        try:
            actors = ray._private.state.actors()  # the GCS actor table (the State API needs the dashboard)
        except Exception:
            actors = {}
        for info in sorted(actors.values(), key=lambda a: a.get("Name") or ""):
            if info.get("State") != "ALIVE" or not info.get("Pid"):
                continue
            for cls, label in self.actor_labels:
                if info.get("ActorClassName", "") != cls:
                    continue
                if label in self.numbered:
                    name = info.get("Name") or str(info["Pid"])
                    count = sum(v.rsplit("-", 1)[0] == label for v in self.numbered_labels.values())
                    label = self.numbered_labels.setdefault(name, f"{label}-{count + 1}")
                out[label] = int(info["Pid"])
        return out

    def usage(self) -> tuple[dict[str, int], dict[str, float], dict[str, int]]:
        """(rss bytes, cpu seconds, pid) per label."""
        rss: dict[str, int] = {}
        cpu: dict[str, float] = {}
        pids = self.pids()
        for label, pid in pids.items():
            try:
                proc = self._handles.get(pid) or self._handles.setdefault(pid, self.psutil.Process(pid))
                with proc.oneshot():
                    rss[label] = proc.memory_info().rss
                    times = proc.cpu_times()
                    cpu[label] = round(times.user + times.system, 3)
            except self.psutil.Error:
                self._handles.pop(pid, None)
        return rss, cpu, pids
