"""Progress on stderr that a user sees in a pipe or a log too: a tqdm bar on a terminal, else one plain
line at most every `every_s` seconds and a last one at the end."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO


class LineProgress:
    """The part of tqdm's interface the commands use, printing whole lines (thread-safe)."""

    def __init__(self, total: int | None, desc: str, unit: str, every_s: float = 10.0,
                 file: TextIO | None = None) -> None:
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.file = file or sys.stderr
        self.n = 0
        self.postfix = ""
        self.started = self.last = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            now = time.monotonic()
            if now - self.last >= self.every_s:
                self.last = now
                self._say(now)

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def set_postfix_str(self, postfix: str) -> None:
        self.postfix = postfix

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._say(time.monotonic())

    def _say(self, now: float) -> None:
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = f" {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {done} {self.unit}{pct} after {now - self.started:.0f} s{extra}", file=self.file,
              flush=True)

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: int | None, desc: str, unit: str, *, disable: bool = False, every_s: float = 10.0) -> Any:
    """A progress bar for `total` steps: tqdm on a terminal, `LineProgress` otherwise; nothing with `disable`."""
    from tqdm import tqdm

    if disable or sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable)
    return LineProgress(total, desc, unit, every_s)
