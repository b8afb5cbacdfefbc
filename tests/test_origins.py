"""CallOrigins: the book of which ingress started each call in flight, so the router ends the calls of
an ingress that died mid-call (and only those, and only once)."""

from __future__ import annotations

import time

from kvflow_ray.router.origins import CallOrigins

A = ("t", "c1", "planner", "r1")
B = ("t", "c2", "executor", "r2")


def test_a_silent_ingress_hands_over_its_calls_once_and_its_late_ends_are_dropped() -> None:
    origins = CallOrigins(silent_s=0.05)
    origins.heard("i1")
    origins.started("i1", A)
    origins.started("i1", A)  # the same agent twice on one replica: two calls
    origins.heard("i2")
    origins.started("i2", B)
    assert origins.ended("i1", A)  # i1 ended one of them itself
    time.sleep(0.06)
    origins.heard("i2")  # i2 is alive, i1 went silent
    assert origins.take_dead() == {"i1": [A]}
    assert origins.take_dead() == {}  # once
    assert not origins.ended("i1", A)  # late: ended for it already
    assert origins.in_flight() == {"i2": 1}
    assert origins.ended("i2", B) and origins.in_flight() == {}


def test_an_ingress_taken_for_dead_that_comes_back_ends_its_new_calls() -> None:
    origins = CallOrigins(silent_s=0.01)
    origins.heard("i1")
    origins.started("i1", A)
    time.sleep(0.02)
    assert origins.take_dead() == {"i1": [A]}
    origins.heard("i1")
    origins.started("i1", B)
    assert origins.ended("i1", B)  # booked after it came back
    assert not origins.ended("i1", A)


def test_a_retry_moves_the_call_off_the_dead_replica_and_unbooked_ends_of_live_ingresses_count() -> None:
    origins = CallOrigins(silent_s=60)
    origins.heard("i1")
    origins.started("i1", A)
    moved = ("t", "c1", "planner", "r2")
    origins.started("i1", moved, retry=True, live=frozenset({"r2"}))
    assert origins.in_flight() == {"i1": 1}
    assert origins.ended("i1", moved) and origins.in_flight() == {}
    # a restarted router books only calls started since: an end it never booked is still an end
    assert origins.ended("i1", B) and origins.ended(None, B)
    assert origins.take_dead() == {}  # heard recently, nothing in flight
