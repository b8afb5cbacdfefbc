"""Ray Serve's routing seam (`ray.serve.request_router.RequestRouter`), told to honour the workflow
router's choice.

The ingress asks the WorkflowRouter actor where an agent call goes and passes the answer as the
`kvflow_replica` argument of the handle call. This router, which Serve runs inside the ingress
process, reads it and ranks that replica first; the decision itself is not repeated here, so the hot
path has no extra actor call. Serve keeps doing what it does best around it: queue-length checks,
backoff, and skipping dead replicas.

- The chosen replica first, then the others: when the chosen one is at `max_ongoing_requests`, the
  request spills rather than waits (the router's balance threshold should keep that rare).
- No choice (a plain request or a control call), or a choice that is not among the live candidates
  (the replica just died): all candidates in one rank, so Serve picks the least loaded one.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ROUTE_KWARG = "kvflow_replica"


class WorkflowRequestRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        chosen = pending_request.kwargs.get(ROUTE_KWARG) if pending_request is not None else None
        if chosen:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == chosen:
                    return [[replica], [r for r in candidate_replicas if r is not replica]]
        return [candidate_replicas]
