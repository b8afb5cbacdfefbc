"""Admission: in which order waiting requests are considered for the next batch.

`status-aware` (KVFlow) holds back a request whose prefix is still loading from the host tier while
other requests are ready, so compute never idles behind a copy it could have overlapped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

R = TypeVar("R")


class AdmissionPolicy(Protocol):
    name: str

    def order(self, waiting: Sequence[R], is_loading: Callable[[R], bool]) -> list[R]:
        """The requests to try to admit now, in order."""
        ...


class FCFSAdmission:
    name = "fcfs"

    def order(self, waiting: Sequence[R], is_loading: Callable[[R], bool]) -> list[R]:
        return list(waiting)


class StatusAwareAdmission:
    name = "status-aware"

    def order(self, waiting: Sequence[R], is_loading: Callable[[R], bool]) -> list[R]:
        ready = [r for r in waiting if not is_loading(r)]
        return ready if ready else list(waiting)
