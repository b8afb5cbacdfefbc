"""Which engine replica each Ray actor is, as the request router in this process last saw them.

A call that fails because its engine replica died names the dead actor (`RayActorError.actor_id`), while
the workflow router names replicas by Serve's unique id. `WorkflowRequestRouter` runs in the process of
the handle's owner (the ingress) and records the actors of the replicas it routes to here; the ingress
reads the name of the one that died. The registry is its own module because Serve ships the request
router's module to that process by value: a dict defined there would be a copy nobody else reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

_REPLICA_OF_ACTOR: dict[str, str] = {}  # actor id (hex) -> replica (Serve's unique id)


def record(replicas: Mapping[str, str]) -> None:
    """The replicas routed to now: unique id -> actor id (hex)."""
    _REPLICA_OF_ACTOR.update({actor: name for name, actor in replicas.items()})


def forget(actors: Iterable[str]) -> None:
    for actor in actors:
        _REPLICA_OF_ACTOR.pop(actor, None)


def replica_of(error: BaseException) -> str | None:
    """The replica whose actor a dead-actor error names, or None: the error names no actor, or one no
    request router in this process routes to (Serve's own request router records nothing)."""
    actor = getattr(error, "actor_id", None)
    return _REPLICA_OF_ACTOR.get(actor) if isinstance(actor, str) else None
