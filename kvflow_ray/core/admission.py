"""Admission: which waiting requests are considered for the next batch, in which order, and what a
request whose prefix is still loading from the host tier does meanwhile.

A policy owns all of that, so the scheduler (`core.scheduler`) and the SGLang plugin's prefill adder
act on the same object: `order` ranks the waiting requests (given those whose cached prefix is
usable now), `loads_while_queued` says whether a
queued request's host -> device load starts at once (status-aware) or only once it is admitted, and
`batch_waits_for_loads` whether a prefill batch waits for a member's load (FCFS) or runs without it.

`status-aware` (KVFlow) holds back a request whose prefix is still loading while other requests
are ready, so compute never idles behind a copy it could have overlapped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvflow_ray.core.registry import Registry

R = TypeVar("R")


class AdmissionPolicy(Protocol):
    name: str
    loads_while_queued: bool  # start a queued request's host -> device load before it is admitted
    batch_waits_for_loads: bool  # a prefill whose KV is loading holds its batch back (else it is passed over)

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> list[R]:
        """The requests to try to admit now, in order. `ready`: the waiting requests whose cached
        prefix is usable now (none of it loading or on the host only), in arrival order."""
        ...


class FCFSAdmission:
    name = "fcfs"
    loads_while_queued = False
    batch_waits_for_loads = True

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> list[R]:
        return list(waiting)


class StatusAwareAdmission:
    name = "status-aware"
    loads_while_queued = True
    batch_waits_for_loads = False

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> list[R]:
        return list(ready) if ready else list(waiting)


ADMISSION: Registry[AdmissionPolicy] = Registry("admission")
# arrival order; a batch waits for its members' loads (SGLang's default)
ADMISSION.register("fcfs", lambda context: FCFSAdmission())
# ready requests first, queued loads start at once (KVFlow)
ADMISSION.register("status-aware", lambda context: StatusAwareAdmission())
