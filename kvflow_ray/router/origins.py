"""Which ingress started each agent call still in flight, so the calls of an ingress that died end too.

An ingress ends its calls itself (their ends ride on its next router call). One killed mid-run never
does: without this book its calls would stay in flight for good, keeping their replicas' load counted
and their clients live (a finished client retires only once its last call ended). So every ingress
that has calls in flight is heard from at least every `beat_s` (any router call counts; an idle
moment costs one beat), and one silent for `silent_s` is taken for dead: its calls are ended for it.
A late end from an ingress taken for dead (it was only slow) is dropped, since its call was ended
already; calls it starts afterwards are booked and ended as usual.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Container

Ended = tuple[str, str, str, str | None]  # an agent call, as its end names it: (tenant, client id, agent, replica)


class CallOrigins:
    def __init__(self, silent_s: float) -> None:
        self.silent_s = silent_s
        self._calls: dict[str, Counter[Ended]] = {}  # ingress -> its calls in flight
        self._heard: dict[str, float] = {}  # ingress -> when it last called (monotonic)
        self._dead: set[str] = set()  # ingresses taken for dead: only ends of calls in their book count

    def heard(self, ingress: str) -> None:
        self._heard[ingress] = time.monotonic()

    def started(self, ingress: str, call: Ended, retry: bool = False, live: Container[str] | None = None) -> None:
        """`ingress` routed `call`. A retry moves the call off a replica that is gone (`live`: the
        replicas that are not), so one end ends it."""
        calls = self._calls.setdefault(ingress, Counter())
        if retry:
            for old in calls:
                if old[:3] == call[:3] and (live is None or old[3] not in live):
                    calls[old] -= 1
                    if not calls[old]:
                        del calls[old]
                    break
        calls[call] += 1

    def ended(self, ingress: str | None, call: Ended) -> bool:
        """`ingress` ended `call`: whether the router should end it. Not when the ingress was taken for
        dead and the call is not in its book (it was ended then). An end the book does not hold from
        a live ingress counts: a restarted router books only the calls started since."""
        if ingress is None:
            return True
        calls = self._calls.get(ingress)
        if calls is None or calls[call] <= 0:
            return ingress not in self._dead
        calls[call] -= 1
        if not calls[call]:
            del calls[call]
        return True

    def take_dead(self) -> dict[str, list[Ended]]:
        """Ingresses silent for `silent_s` with calls in flight, each with those calls (which the caller
        ends); from now on their ends are dropped. O(ingresses)."""
        horizon = time.monotonic() - self.silent_s
        dead: dict[str, list[Ended]] = {}
        for ingress in [i for i, at in self._heard.items() if at < horizon]:
            del self._heard[ingress]
            calls = self._calls.pop(ingress, None)
            if calls:
                dead[ingress] = list(calls.elements())
                self._dead.add(ingress)
        return dead

    def in_flight(self) -> dict[str, int]:
        return {ingress: sum(calls.values()) for ingress, calls in self._calls.items() if calls}
