"""Ray Serve's routing seam (`ray.serve.request_router.RequestRouter`), told to honour the workflow
router's choice.

The ingress's own router (`IngressRouter`) decides where an agent call goes, and the ingress passes the
answer as the `kvflow_replica` argument of the handle call. This router, which Serve runs inside the ingress
process, reads it and ranks that replica first; the decision itself is not repeated here, so the hot
path has no extra actor call. Serve keeps doing what it does best around it: queue-length checks,
backoff, and skipping dead replicas.

- The chosen replica first, then the others: when the chosen one is at `max_ongoing_requests`, the
  request spills rather than waits (the router's balance threshold should keep that rare).
- No choice (a plain request or a control call), or a choice that is not among the live candidates
  (the replica just died): all candidates in one rank, so Serve picks the least loaded one.
- A replica that dies, or leaves the set Serve routes to, is dropped from the router actor at once
  (`on_replica_actor_died`, `update_replicas`: Serve's own seams), and from every ingress's router with
  its next sync, without waiting for its heartbeats to stop.
- A call that fails because its replica died names the dead actor, not the replica: the replicas'
  actors are recorded in `replica_actors`, so the ingress drops the one that died, which is not the
  chosen one when the call had spilled.

Serve ships this module to the ingress by value (cloudpickle): what it shares with the ingress lives
in modules it imports at call time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

if TYPE_CHECKING:
    from ray.serve._private.common import ReplicaID

ROUTE_KWARG = "kvflow_replica"
logger = logging.getLogger(__name__)


def _drop_from_workflow_router(name: str) -> None:
    """One way: Serve calls the hooks below on its event loop, which must not wait on the router."""
    from kvflow_ray.serve.router_actor import get_router

    try:
        get_router(create=False).remove_replica.remote(name)
    except Exception:  # no router (restarting): its stale-heartbeat check drops the replica later
        logger.warning("could not tell the workflow router that replica %s is gone", name, exc_info=True)


class WorkflowRequestRouter(RequestRouter):
    _actors: Mapping[str, str] = MappingProxyType({})  # the replicas Serve routes to now: unique id -> actor id

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        from kvflow_ray.serve import replica_actors

        current = {r.replica_id.unique_id: r.actor_id.hex() for r in replicas}
        gone = {name: actor for name, actor in self._actors.items() if name not in current}
        self._actors = current
        super().update_replicas(replicas)
        # Serve's controller reports a dead replica gone after its calls in flight have failed (they
        # fail as the actor dies), so each failed call can still be told whose it was
        replica_actors.record(current)
        replica_actors.forget(gone.values())
        for name in gone:
            _drop_from_workflow_router(name)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        _drop_from_workflow_router(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        chosen = pending_request.kwargs.get(ROUTE_KWARG) if pending_request is not None else None
        if chosen:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == chosen:
                    return [[replica], [r for r in candidate_replicas if r is not replica]]
        return [candidate_replicas]
