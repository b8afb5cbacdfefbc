"""The serving router's part in the simulator: every call goes through the `RouterCore` that serves
(and its `core.routing` policy), with no Ray.

As when serving:
- a call is routed by `start_call` (its prompt's fixed-prefix hash, tokens and namespace) and ended by
  `end_call`; its first token is reported (`prefilled`, for policies that count prefill in flight);
- replicas report their cache events (`CacheEventLog`, the same hooks as the engines') and their
  device KV usage and queue; the router sees them before each decision;
- hints (steps-to-execution, `elsewhere`, retirements) go only to the replicas the router names,
  from its outbox; a replica learns a workflow's prompts the first time it hears of it.
Idealised: reports, events and hints arrive without delay (a serving router hears of them within a
heartbeat). Deterministic: routing state uses the simulated clock or logical counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow_ray.core.routing import create_routing
from kvflow_ray.engines.base import prefix_hash
from kvflow_ray.router.core import RouterCore, split_workflow_key
from kvflow_ray.router.limits import TenantLimits
from kvflow_ray.router.store import BufferedStore, MemoryStore

if TYPE_CHECKING:
    from kvflow_ray.engines.sim.replica import SimReplica, SimRequest
    from kvflow_ray.engines.sim.simulator import ClientPlan, Simulation

FLUSH_EVERY = 1000  # calls between flushes of the router's write-behind store (the actor flushes every few ms)
# the operator's limits for a simulated fleet: room for every simulated tenant's workflows
SIM_LIMITS = TenantLimits(max_live_clients=1 << 30, max_templates=1 << 20, template_write_burst=1 << 20)


class SimRouter:
    def __init__(self, sim: Simulation, routing: str, seed: int = 0) -> None:
        """`routing`: a `core.routing.parse_routing` name, options allowed."""
        self.sim = sim
        self.core = RouterCore(BufferedStore(MemoryStore(ttl_s=1e9, clock=lambda: sim.now)),
                               create_routing(routing, seed), limits=SIM_LIMITS)
        self.replicas: dict[str, SimReplica] = {}
        for replica in sim.replicas:
            name = f"r{replica.index}"
            self.replicas[name] = replica
            self.core.add_replica(name)
        self._plans: dict[str, ClientPlan] = {}
        self._templates: set[tuple[str, str]] = set()
        self._prefix_hashes: dict[tuple[str, str], str | None] = {}  # (workflow, agent) -> its fixed prompt's
        self._calls = 0

    # ------------------------------------------------------------------ the client's side
    def add_client(self, plan: ClientPlan) -> None:
        tenant, _client = split_workflow_key(plan.key)
        self._plans[plan.key] = plan
        if (tenant, plan.spec.name) not in self._templates:
            self._templates.add((tenant, plan.spec.name))
            self.core.put_template(tenant, plan.spec.to_dict())

    def submit(self, req: SimRequest) -> None:
        plan = self._plans[req.workflow]
        tenant, client = split_workflow_key(req.workflow)
        prompt = plan.prompts[req.agent]
        key = (req.workflow, req.agent)
        if key not in self._prefix_hashes:  # what the ingress computes from the request, once per agent here
            self._prefix_hashes[key] = prefix_hash(prompt, plan.salt) if prompt else None
        self._observe()
        route = self.core.start_call(tenant, client, req.agent, workflow=plan.spec.name,
                                     prefix_hash=self._prefix_hashes[key], prefix_tokens=len(prompt),
                                     cache_salt=plan.salt, tokens=req.tokens, max_new=req.max_new)
        self._deliver()
        replica = self.replicas[route.replica]
        req.on_prefilled = lambda r: self.core.prefilled(tenant, client, r.agent, route.replica)
        done = req.on_done
        assert done is not None

        def ended(r: SimRequest) -> None:
            self.core.end_call(tenant, client, r.agent, route.replica)
            self._deliver()
            done(r)

        req.on_done = ended
        replica.submit(req)
        self._calls += 1
        if self._calls % FLUSH_EVERY == 0:
            self.core.store.flush()

    def retire(self, workflow: str) -> None:
        tenant, client = split_workflow_key(workflow)
        self.core.finish_client(tenant, client)
        self._deliver()

    # ------------------------------------------------------------------ the replicas' side
    def _observe(self) -> None:
        """What the replicas report before a decision: their cache events, KV usage and queue."""
        core = self.core
        for name, replica in self.replicas.items():
            events = replica.events
            if events is not None:
                drained = events.drain()
                if drained:
                    core.cache_events(name, drained)
            cache = replica.cache
            core.fleet.report(name, usage=cache.used_tokens / cache.gpu_capacity, waiting=len(replica.waiting),
                              capacity=cache.gpu_capacity)

    def _deliver(self) -> None:
        """The router's outbox to the replicas it names (a replica new to a workflow gets its prompts)."""
        for name in self.core.pending_hints():
            batch = self.core.take_hints(name)
            if batch is None:
                continue
            replica = self.replicas[name]
            prompts = {}
            for workflow in batch.prompts.keys() | batch.steps.keys():
                plan = self._plans.get(workflow)
                if plan is not None and not replica.book.live(workflow):
                    prompts.update({(workflow, agent): tokens for agent, tokens in plan.prompts.items()})
            replica.scheduler.apply_hints(batch.steps, prompts, batch.retire, batch.salts, batch.elsewhere)
