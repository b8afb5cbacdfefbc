"""The workflow router's logic, without Ray: serving's router actor and the simulator wrap one.

It keeps, per tenant, workflow templates (`templates.Templates`) and every client's live step-graph
state (`clients.Clients`) in the `Store` (so a restarted router resumes where it stopped), knows
which replica holds which prefix (`holdings.Holdings`, from the replicas' cache events), picks a
replica for each agent call (the routing policy, `core.routing`), and says which steps-to-execution
each replica should now use (`hints.HintOutbox`). `RouterCore` is the call flow over those parts.

Tenancy: every operation names its tenant; client ids and templates are looked up only inside it,
so tenant A cannot read, finish or steer tenant B's client `c1` even when both use that name. The
engine-level workflow key is `tenant/client_id`, so two tenants' clients never share cache tags.

Hints are advisory. A call for an agent that the graph says is not ready is still routed and
served; the live state follows what actually ran, and the deviation is counted.

Memory is the working state and the store its durable copy (`BufferedStore`): everything is loaded
once at start, every change is written behind, and no decision reads the store. So a store outage
costs no call (within the grace period), and a store that lost data gets the router's state back
(`reconcile`). Every structure is bounded by the tenants' limits and expires: clients idle for the
state TTL, templates unused for the template TTL; removing one client is O(replicas).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow_ray.core.graph import UnknownAgentError, WorkflowSpec, WorkflowState
from kvflow_ray.core.predict import Forecaster, likely_reach
from kvflow_ray.core.routing import DEFAULT_ROUTING, ROUTING, Fleet, RouteRequest, RoutingPolicy
from kvflow_ray.engines.base import CacheEvent, Hints
from kvflow_ray.router.clients import Client, Clients
from kvflow_ray.router.errors import (
    NoReplicaError,
    TenantLimitError,
    UnknownClientError,
    UnknownWorkflowError,
)
from kvflow_ray.router.hints import HintBatch, HintOutbox
from kvflow_ray.router.holdings import Holdings
from kvflow_ray.router.limits import TenantLimits
from kvflow_ray.router.settings import RouterSettings
from kvflow_ray.router.store import BufferedStore, Store, check_name
from kvflow_ray.router.templates import Templates

__all__ = ["HintBatch", "NoReplicaError", "Route", "RouterCore", "TenantLimitError", "UnknownClientError",
           "UnknownWorkflowError", "application_key", "split_workflow_key", "workflow_key"]


@dataclass
class Route:
    replica: str
    outcome: str  # affinity | balanced | cold
    workflow_key: str  # tenant/client_id: the engine-level workflow instance
    fixed_prompt: str | None  # the agent's prompt text from the template, if any
    deviation: bool  # the agent was not ready per the step graph (served anyway)
    hints: list[tuple[str, Hints]] = field(default_factory=list)  # (replica, hints) to push
    call: int = 0  # this router's number for the call (the engine reports it with the first token)


def workflow_key(tenant: str, client_id: str) -> str:
    return f"{tenant}/{client_id}"


def call_name(key: str, agent: str, call: int) -> str:
    """A call's name, the same in every router: its workflow key, agent and its router's number for
    it, as its replica reports its first token."""
    return f"{key}\x00{agent}\x00{call}"


def split_workflow_key(key: str) -> tuple[str, str]:
    """`workflow_key`'s inverse: (tenant, client id); a key without a tenant is the default tenant's
    (tenant names never hold '/')."""
    tenant, sep, client_id = key.partition("/")
    return (tenant, client_id) if sep else ("default", key)


def application_key(tenant: str, workflow: str) -> str:
    """The application a call belongs to, as routing policies see it (`RouteRequest.group`)."""
    return f"{tenant}/{workflow}"


class RouterCore:
    def __init__(self, store: Store | BufferedStore, policy: RoutingPolicy | None = None,
                 prefetch_horizon: int = 1, limits: TenantLimits | None = None,
                 template_ttl_s: float | None = None, prediction: str = "graph", *, owner: bool = True) -> None:
        """`prediction`: how agents are ranked in the hints (`core.predict.PREDICTION`): `graph`
        (steps-to-execution), `priors` or `learned` (expected steps; `learned` learns each tenant's
        templates' choices from the calls it routes and keeps the models in the store).
        `owner`: this core owns the templates and the holdings (loads them, writes them); otherwise
        (an ingress replica's core, `router/peers.py`) it holds copies the router actor sends, and
        owns only its clients, which it recalls from the store one by one, not all at start."""
        # a plain store (tests, tools): every write goes through at once
        self.store = store if isinstance(store, BufferedStore) else BufferedStore(store, sync=True)
        self.limits = limits or TenantLimits()
        self.policy = policy or ROUTING.create(DEFAULT_ROUTING)
        self.prefetch_horizon = prefetch_horizon  # the engines prefetch agents this many steps ahead
        # the live replicas as routing sees them; `loads`: requests queued or running there
        self.fleet = Fleet()
        self.loads = self.fleet.loads
        # templates outlive the clients using them
        self.owner = owner
        self.templates = Templates(self.store, self.limits, max(template_ttl_s or 0.0, self.store.ttl_s),
                                   copy=not owner)
        self.clients = Clients(self.store, self.limits)
        self.holdings = Holdings(self.store, self.fleet.blocks, persist=owner)
        self.outbox = HintOutbox()
        self.forecast = Forecaster(prediction)
        self.decisions: Counter[str] = Counter()
        self.deviations = 0
        self.calls = Counter[str]()  # start_call / end_call / finish_client invocations (for per-call cost)
        self.decision_seconds: deque[float] = deque(maxlen=10_000)  # recent decision latencies (all of start_call)
        self.policy_seconds: deque[float] = deque(maxlen=10_000)  # ... of which the routing policy's `route`
        self.finish_seconds: deque[float] = deque(maxlen=10_000)  # recent finish_client latencies (wall)
        self.finish_cpu_seconds: deque[float] = deque(maxlen=10_000)  # ... and the CPU each took (this thread)
        self.templates.load()
        if owner:
            self.clients.load()
        self.holdings.load()
        if self.store.get_marker() is None:
            self.store.set_marker("kvflow-router")

    @classmethod
    def from_settings(cls, store: Store | BufferedStore, settings: RouterSettings, *, owner: bool = True) -> RouterCore:
        return cls(store, settings.policy(), prefetch_horizon=settings.prefetch_horizon, limits=settings.limits,
                   template_ttl_s=settings.template_ttl_s, prediction=settings.prediction, owner=owner)

    def reconcile(self) -> int:
        """Queue the router's whole durable state for the store (after an outage, or a store that lost
        data): templates, kept versions, live clients, locations and the marker. O(state), rare."""
        writes = self.templates.reconcile() + self.clients.reconcile() + self.holdings.reconcile()
        self.store.set_marker("kvflow-router")
        return writes

    # ------------------------------------------------------------------ replicas
    def add_replica(self, name: str) -> None:
        self.fleet.add(check_name("replica", name))

    def remove_replica(self, name: str) -> None:
        """A dead replica: its load, outbox and prefixes are forgotten at once (O(what it held + live
        clients), rare), so its clients' next calls route elsewhere, and a replica that comes back
        under the name starts at 0."""
        self.fleet.remove(name)
        self.policy.removed(name)
        self.outbox.drop(name)
        self.holdings.drop(name)

    def cache_events(self, replica: str, events: Iterable[CacheEvent], seq: int | None = None) -> None:
        """Replica `replica` reports prefixes stored in / removed from a tier (batch `seq` of its feed)."""
        self.holdings.feed(replica, events, seq)

    def cache_snapshot(self, replica: str, seq: int, events: Iterable[CacheEvent] | None) -> None:
        """Everything `replica` holds as of batch `seq`, after its feed had a gap (`snapshot_due`)."""
        self.holdings.replace(replica, seq, events)

    def snapshot_due(self, replica: str) -> bool:
        return self.holdings.stale(replica)

    # ------------------------------------------------------------------ templates
    def put_template(self, tenant: str, spec: Mapping[str, Any]) -> WorkflowSpec:
        return self.templates.put(tenant, spec)

    def template(self, tenant: str, name: str) -> WorkflowSpec:
        return self.templates.get(tenant, name).spec

    def client_workflow(self, tenant: str, client_id: str) -> str:
        """The workflow a live client runs (for requests that name only the client and agent)."""
        check_name("client_id", client_id)
        record = self.clients.get(tenant, client_id)
        if record is None or (tenant, client_id) in self.clients.finishing:
            raise UnknownClientError(f"unknown client {client_id!r}: its first request must name the workflow"
                                     + (" (it is finished; its last calls are completing)" if record else ""))
        return str(record["workflow"])

    # ------------------------------------------------------------------ calls
    def _load_client(self, tenant: str, client_id: str) -> tuple[WorkflowSpec, WorkflowState, dict[str, Any]]:
        record = self.clients.get(tenant, client_id)
        if record is None:
            raise UnknownClientError(f"unknown client {client_id!r}: start it with a request that names its workflow")
        spec = self.templates.spec_of(tenant, record["workflow"], record.get("version"))
        return spec, WorkflowState.from_dict(spec, record["state"]), record

    def _save_client(self, tenant: str, client_id: str, spec: WorkflowSpec, state: WorkflowState,
                     record: dict[str, Any]) -> None:
        record["workflow"] = spec.name
        record["state"] = state.to_dict()
        self.clients.save(tenant, client_id, record)

    def start_call(self, tenant: str, client_id: str, agent: str, *, workflow: str | None = None,
                   prefix_hash: str | None = None, prefix_tokens: int = 0, cache_salt: str = "",
                   retry_from: str | None = None, tokens: Sequence[int] = (), max_new: int = 0) -> Route:
        """An agent call arrives: update the client's state, pick a replica, compute the hints.
        `cache_salt`: the cache namespace of the tenant's requests (the engines' prompts for prefetch
        live there); `prefix_hash` is already salted. Every check runs before any state changes.
        `retry_from`: the same call again, after an engine replica died under it; the replica it was
        counted on, dead or not (Serve may have run it elsewhere), lets go of it (one end_call ends it).
        `tokens` / `max_new`: the prompt's token ids and output budget, for policies that read them
        (prefix trees, block look-ups); without them a policy prices the fixed prompt alone."""
        started = time.perf_counter()
        self.calls["start_call"] += 1
        check_name("client_id", client_id)
        self.store.check()
        client = (tenant, client_id)
        if client in self.clients.finishing:
            raise UnknownClientError(f"unknown client {client_id!r}: it is finished (its last calls are completing)")
        record = self.clients.get(tenant, client_id)
        if record is None or (workflow is not None and record["workflow"] != workflow):
            if workflow is None:
                raise UnknownClientError(f"unknown client {client_id!r}: its first request must name the workflow")
            template = self.templates.get(tenant, workflow)
            spec = template.spec
            state = WorkflowState(spec, running=[])
            record = {"workflow": spec.name, "version": template.version, "placement": {}}
            fresh = True
        else:
            spec, state, record = self._load_client(tenant, client_id)
            fresh = False
        if agent not in spec.agents:
            raise UnknownAgentError(agent, spec.name, spec.agents)
        if not self.loads:
            raise NoReplicaError("no live engine replica to route to (starting up or all lost); retry shortly")
        if retry_from is not None:
            self._release(client, agent, retry_from)
        self.clients.touch(tenant, client_id, True, self._forget_client)
        record["salt"] = cache_salt
        deviation = not (agent in state.running or state.ready(agent) or (fresh and agent in spec.start_agents()))
        if deviation:
            self.deviations += 1
        self._learn(tenant, spec, state, record, agent)
        state.start(agent)
        request = RouteRequest(tokens, cache_salt, prefix_hash, prefix_tokens,
                               self.holdings.holders(prefix_hash) if prefix_hash else {}, record.get("home"), max_new,
                               group=application_key(tenant, spec.name),
                               name=call_name(workflow_key(tenant, client_id), agent, self.calls["start_call"]))
        asked = time.perf_counter()
        decision = self.policy.route(request, self.fleet)
        self.policy_seconds.append(time.perf_counter() - asked)
        self.policy.routed(request, decision.replica)
        self.clients.started(client, (agent, decision.replica, request), again=retry_from is not None)
        record["placement"][agent] = decision.replica
        record["home"] = decision.replica
        if prefix_hash:  # where this agent's prompt lives next time: for prefetch hints (below)
            record.setdefault("prefixes", {})[agent] = [prefix_hash, prefix_tokens]
        if prefix_hash and decision.tier is None:
            self.holdings.foresee(prefix_hash, decision.replica)
        self._save_client(tenant, client_id, spec, state, record)
        self.loads[decision.replica] += 1
        self.decisions[decision.outcome] += 1
        key = workflow_key(tenant, client_id)
        route = Route(decision.replica, decision.outcome, key, spec.agents[agent].prompt, deviation,
                      self._hints(tenant, key, state, spec, record), self.calls["start_call"])
        self.decision_seconds.append(time.perf_counter() - started)
        return route

    def end_call(self, tenant: str, client_id: str, agent: str, replica: str | None = None) -> list[tuple[str, Hints]]:
        """The call finished (served or failed): the agent is done; new steps go to the replicas. A
        client finished (or expired) meanwhile costs the call nothing: it still returns its answer,
        and a finished client retires once its last call has ended."""
        self.calls["end_call"] += 1
        client = (tenant, client_id)
        self._release(client, agent, replica)
        self.clients.ended(client)
        if client in self.clients.finishing:
            return self._finish(tenant, client_id) if client not in self.clients.calls else []
        if self.clients.get(tenant, client_id) is None:
            return []
        spec, state, record = self._load_client(tenant, client_id)
        if agent not in spec.agents:
            raise UnknownAgentError(agent, spec.name, spec.agents)
        state.finish(agent)
        self._save_client(tenant, client_id, spec, state, record)
        self.clients.touch(tenant, client_id, False, self._forget_client)
        return self._hints(tenant, workflow_key(tenant, client_id), state, spec, record)

    def _release(self, client: Client, agent: str, replica: str | None) -> None:
        """The oldest call of `agent` in flight on `replica` (any replica when None) stops counting
        there: its load, while the replica lives, and its place in the routing policy's books."""
        if replica is not None and self.loads.get(replica, 0) > 0:
            self.loads[replica] -= 1
        call = self.clients.take_routed(client, agent, replica)
        if call is not None:
            self.policy.ended(call[2], call[1])

    def prefilled(self, tenant: str, client_id: str, agent: str, replica: str, number: int | None = None) -> None:
        """The call's first token came back (its prompt is computed): for policies that count
        prefill work in flight. `number`: its router's number for it, which tells this router's call
        from an earlier one of the same agent; a call this router did not route is another router's
        (an ingress hears every replica's first tokens), named to the policy by it."""
        name = call_name(workflow_key(tenant, client_id), agent, number) if number is not None else None
        call = self.clients.in_flight((tenant, client_id), agent, replica)
        if call is not None and (name is None or call[2].name == name):
            self.policy.prefilled(call[2], replica)
        elif name is not None:
            self.policy.prefilled(RouteRequest(name=name), replica)

    def first_tokens(self, replica: str, calls: Iterable[Sequence[Any]]) -> None:
        """`replica` sent the first token of these calls ((workflow key, agent, the router's number
        for the call) each, as the engine request names them; the number may be missing): `prefilled`
        for each."""
        for key, agent, *number in calls:
            self.calls["first_token"] += 1
            self.prefilled(*split_workflow_key(key), agent, replica, number[0] if number else None)

    def finish_client(self, tenant: str, client_id: str) -> list[tuple[str, Hints]]:
        """`POST /v1/clients/{id}/finish`: the workflow instance is over; its prompts are retired, at
        once, or when its calls still running have ended."""
        started, started_cpu = time.perf_counter(), time.thread_time()
        self.calls["finish_client"] += 1
        check_name("client_id", client_id)
        self.store.check()
        client = (tenant, client_id)
        if client in self.clients.finishing:
            return []
        if self.clients.get(tenant, client_id) is None:
            if self.clients.was_finished(client):  # a finish sent again: answered as the first was
                return []
            raise UnknownClientError(f"unknown client {client_id!r}")
        if client in self.clients.calls:
            self.clients.finishing.add(client)
            return []
        hints = self._finish(tenant, client_id)
        self.finish_seconds.append(time.perf_counter() - started)
        self.finish_cpu_seconds.append(time.thread_time() - started_cpu)
        return hints

    def _finish(self, tenant: str, client_id: str) -> list[tuple[str, Hints]]:
        self.clients.close(tenant, client_id)
        return self._forget_client(tenant, client_id)

    def _forget_client(self, tenant: str, client_id: str) -> list[tuple[str, Hints]]:
        """Everything the router holds for a client that is over (finished or expired), O(replicas):
        its record and live entry, what replicas were told; and a retire hint for every replica that
        heard of it, so their books and tags let go of it too."""
        self.clients.forget(tenant, client_id)
        return self.outbox.retire(workflow_key(tenant, client_id), self.loads.keys())

    def release(self, tenant: str, client_id: str) -> None:
        """Another router took the client over (an ingress that recalled it from the store): it is
        forgotten here without retiring it, since it goes on there. O(1)."""
        self.clients.forget(tenant, client_id)
        self.outbox.forget(workflow_key(tenant, client_id))

    def expire(self) -> int:
        """Retire every client idle for longer than the state TTL (its store entry expires by the same
        TTL) and drop templates unused for the template TTL; O(tenants + what expired). The router
        actor calls it once a second. How many clients expired."""
        self.templates.expire()
        return self.clients.expire_all(self._forget_client)

    def sizes(self) -> dict[str, int]:
        """How much state the router holds (a soak watches these stay bounded)."""
        return {"live_clients": len(self.clients.records), "templates": self.templates.count(),
                "old_versions": len(self.templates.old_versions), "locations": len(self.holdings),
                **self.outbox.sizes(), "calls_in_flight": len(self.clients.calls)}

    def take_hints(self, replica: str) -> HintBatch | None:
        """The hints waiting for `replica` (removed from the outbox), or None."""
        return self.outbox.take(replica)

    def pending_hints(self) -> list[str]:
        return self.outbox.pending()

    def has_hints(self, replica: str) -> bool:
        return self.outbox.has(replica)

    def active_clients(self) -> Counter[str]:
        """Live workflow instances per tenant (the `kvflow_workflows_active` gauge), from memory:
        O(tenants + what expired since the last count), never a store scan."""
        return self.clients.active(self._forget_client)

    # ------------------------------------------------------------------ prediction and hints
    def _learn(self, tenant: str, spec: WorkflowSpec, state: WorkflowState, record: dict[str, Any],
               agent: str) -> None:
        """Before `agent` starts, under a `learned` forecast of a dynamic workflow: the client's recent
        history moves on and the choice that led here is counted in the template's model (loaded from
        the store on first use; written back, coalesced by the store's write buffer)."""
        if not (spec.dynamic and self.forecast.learns):
            return
        if (tenant, spec.name) not in self.forecast.book.models:
            try:
                saved = self.store.get_model(tenant, spec.name)
            except Exception:  # the model is an optimisation: a store error leaves it cold
                saved = None
            if isinstance(saved, dict):
                self.forecast.book.model(tenant, spec.name).load(saved)
        record["history"] = self.forecast.started(tenant, spec.name, state, record.get("history") or [], agent)
        self.store.put_model(tenant, spec.name, self.forecast.book.model(tenant, spec.name).to_dict(),
                             ttl_s=self.templates.ttl_s)

    def prediction_accuracy(self) -> dict[str, tuple[int, int]]:
        """(hits, predictions) of the most likely next agent, one and two steps ahead, over every
        learned model held (the `kvflow_prediction_accuracy` gauge)."""
        hits_1 = total_1 = hits_2 = total_2 = 0
        for model in self.forecast.book.models.values():
            acc = model.accuracy
            hits_1, total_1 = hits_1 + acc.hits_1, total_1 + acc.total_1
            hits_2, total_2 = hits_2 + acc.hits_2, total_2 + acc.total_2
        return {"1": (hits_1, total_1), "2": (hits_2, total_2)}

    def _hints(self, tenant: str, key: str, state: WorkflowState, spec: WorkflowSpec,
               record: dict[str, Any]) -> list[tuple[str, Hints]]:
        """New steps-to-execution of one workflow instance for the replicas it concerns: those it ran
        on (their caches hold nodes tagged by it; tags are per instance, so no other replica ranks
        anything by its steps) and those its upcoming agents will be routed to, which prefetch for
        them (`HintOutbox.update`)."""
        steps = self.forecast.steps(tenant, spec.name, state, record.get("history") or ())
        targets = self._prefetch_targets(steps, record, application_key(tenant, spec.name))
        return self.outbox.update(
            key, steps, str(record.get("salt", "")), record["placement"].values(), targets,
            lambda: {agent: a.prompt for agent, a in spec.agents.items() if a.prompt}, self.loads.keys())

    def _prefetch_targets(self, steps: dict[str, float], record: dict[str, Any], group: str) -> dict[str, str]:
        """Where each agent about to run (0 < E <= horizon) would be routed now: the same decision
        `start_call` makes, from where its prompt was seen last and the workflow's home. Agents
        never called yet, with no home to go to, have no target (every replica may prefetch)."""
        targets: dict[str, str] = {}
        if not self.loads:
            return targets
        prefixes = record.get("prefixes", {})
        home = record.get("home")
        horizon = (likely_reach(self.prefetch_horizon) if self.forecast.predictor.weighted
                   else self.prefetch_horizon)
        for agent, e in steps.items():
            if not 0 < e <= horizon:
                continue
            prefix_hash, tokens = prefixes.get(agent, (None, 0))
            if prefix_hash is None and home not in self.loads:
                continue
            holders = self.holdings.holders(prefix_hash) if prefix_hash else {}
            ask = RouteRequest(prefix_hash=prefix_hash, prefix_tokens=tokens, holders=holders, home=home, group=group)
            targets[agent] = self.policy.route(ask, self.fleet).replica
        return targets
