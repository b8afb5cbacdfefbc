"""The workflow router's logic, without Ray: serving's router actor and the simulator wrap one.

It keeps, per tenant, workflow templates and every client's live step-graph state in the `Store`
(so a restarted router resumes where it stopped), knows which replica holds which prefix (from the
replicas' cache events), picks a replica for each agent call (`core.routing`), and says which
steps-to-execution each replica should now use (`Hints`).

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

import hashlib
import json
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow_ray.core.graph import UnknownAgentError, WorkflowSpec, WorkflowState, parse_spec
from kvflow_ray.core.predict import Forecaster, likely_reach
from kvflow_ray.core.routing import DEFAULT_ROUTING, ROUTING, Fleet, RouteRequest, RoutingPolicy
from kvflow_ray.engines.base import CacheEvent, Hints
from kvflow_ray.router.limits import TenantLimits
from kvflow_ray.router.store import BufferedStore, Store, check_name


class _NotFound(KeyError, ValueError):
    """A failed lookup caused by a request (so also a ValueError); prints its message unquoted."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownClientError(_NotFound):
    """A client id this tenant never started (or that expired / was finished)."""


class UnknownWorkflowError(_NotFound):
    """A workflow template this tenant never registered."""


class TenantLimitError(ValueError):
    """A tenant asked for more than its limits allow (`TenantLimits`); `limit` names the field."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{message} (limits.{limit})")
        self.limit, self.detail = limit, message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses Ray intact
        return type(self), (self.limit, self.detail)


class NoReplicaError(RuntimeError):
    """No engine replica is registered (starting up, or all lost): the caller should retry later."""


@dataclass
class Route:
    replica: str
    outcome: str  # affinity | balanced | cold
    workflow_key: str  # tenant/client_id: the engine-level workflow instance
    fixed_prompt: str | None  # the agent's prompt text from the template, if any
    deviation: bool  # the agent was not ready per the step graph (served anyway)
    hints: list[tuple[str, Hints]] = field(default_factory=list)  # (replica, hints) to push


@dataclass
class HintBatch:
    """What waits to be pushed to one replica, merged: the latest steps of each workflow instance,
    the agents' fixed prompts (text; the replica tokenizes) of instances it has not been told about
    yet, and finished instances. Plain data, so it crosses process boundaries as is."""

    steps: dict[str, dict[str, float]] = field(default_factory=dict)
    prompts: dict[str, dict[str, str]] = field(default_factory=dict)
    retire: list[str] = field(default_factory=list)
    salts: dict[str, str] = field(default_factory=dict)  # instance -> its cache namespace (with its prompts)
    # instance -> agents about to run that the routing policy sends to another replica (sent with its steps)
    elsewhere: dict[str, list[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.steps or self.prompts or self.retire)


OLD_VERSIONS_IN_MEMORY = 1024  # replaced template versions kept parsed (the store keeps them for the state TTL)


@dataclass
class _Template:
    """A tenant's current template: its parsed spec and version id, the digest of the request body
    that registered it (re-sending that body writes nothing), when it was last used, and when its
    store copy's idle TTL was last renewed."""

    spec: WorkflowSpec
    version: str
    sent: bytes | None
    used_at: float
    renewed_at: float


def _digest(spec: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=16).digest()


def workflow_key(tenant: str, client_id: str) -> str:
    return f"{tenant}/{client_id}"


def application_key(tenant: str, workflow: str) -> str:
    """The application a call belongs to, as routing policies see it (`RouteRequest.group`)."""
    return f"{tenant}/{workflow}"


class RouterCore:
    def __init__(self, store: Store | BufferedStore, policy: RoutingPolicy | None = None,
                 prefetch_horizon: int = 1, limits: TenantLimits | None = None,
                 template_ttl_s: float | None = None, prediction: str = "graph") -> None:
        """`prediction`: how agents are ranked in the hints (`core.predict.PREDICTION`): `graph`
        (steps-to-execution), `priors` or `learned` (expected steps; `learned` learns each tenant's
        templates' choices from the calls it routes and keeps the models in the store)."""
        # a plain store (tests, tools): every write goes through at once
        self.store = store if isinstance(store, BufferedStore) else BufferedStore(store, sync=True)
        self.limits = limits or TenantLimits()
        self.spec_limits = self.limits.spec_limits()
        self.template_ttl_s = max(template_ttl_s or 0.0, self.store.ttl_s)  # never shorter than a client's life
        self.policy = policy or ROUTING.create(DEFAULT_ROUTING)
        self.prefetch_horizon = prefetch_horizon  # the engines prefetch agents this many steps ahead
        # the live replicas as routing sees them; `loads`: requests queued or running there
        self.fleet = Fleet()
        self.loads = self.fleet.loads
        self.decisions: Counter[str] = Counter()
        self.deviations = 0
        self.calls = Counter[str]()  # start_call / end_call / finish_client invocations (for per-call cost)
        self.decision_seconds: deque[float] = deque(maxlen=10_000)  # recent decision latencies (all of start_call)
        self.policy_seconds: deque[float] = deque(maxlen=10_000)  # ... of which the routing policy's `route`
        self.finish_seconds: deque[float] = deque(maxlen=10_000)  # recent finish_client latencies (wall)
        self.finish_cpu_seconds: deque[float] = deque(maxlen=10_000)  # ... and the CPU each took (this thread)
        # per tenant: current templates, least recently used first (idle ones leave from the front)
        self._templates: dict[str, OrderedDict[str, _Template]] = {}
        # replaced template versions live clients may still use, by (tenant, name@version)
        # (kept, like their store copies, for the state TTL after they were replaced; oldest first)
        self._old_versions: OrderedDict[tuple[str, str], tuple[float, WorkflowSpec]] = OrderedDict()
        # replica -> prefix -> tiers it holds the prefix in (a write-back briefly holds both)
        self._held: dict[str, dict[str, set[str]]] = {}
        self._locations: dict[str, dict[str, str]] = {}  # prefix hash -> {replica: best tier}
        self._clients: dict[tuple[str, str], dict[str, Any]] = {}  # live clients' records
        # per tenant: live clients, least recently called first (expired ones leave from the front, so
        # counting them is O(what expired))
        self._live: dict[str, OrderedDict[str, float]] = {}
        self._outbox: dict[str, HintBatch] = {}  # replica -> hints not yet pulled
        # workflow key -> the replicas that hear of it (its steps, prompts, retirement): those it ran on or
        # will be routed to; absent (a new instance, or after a restart): not known, retire everywhere
        self._told: dict[str, set[str]] = {}
        # calls started and not yet ended, per (tenant, client); a client finished meanwhile retires
        # when its last call ends, so the call still returns its answer
        self._calls: Counter[tuple[str, str]] = Counter()
        # the calls in flight as the policy saw them, per client: (agent, replica, request), for its hooks
        self._routed: dict[tuple[str, str], list[tuple[str, str, RouteRequest]]] = {}
        self._finishing: set[tuple[str, str]] = set()
        self._write_tokens: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)
        self.forecast = Forecaster(prediction)
        self._load()

    def _load(self) -> None:
        """Everything the store holds, once, at (re)start."""
        now = time.monotonic()
        for tenant, name, raw in self.store.template_items():
            spec = parse_spec(raw)
            if "@" in name:  # a replaced version kept for its live clients
                self._remember_version(tenant, name, spec)
            else:
                self._templates.setdefault(tenant, OrderedDict())[name] = _Template(
                    spec, self._version_id(spec), None, now, now)
        for tenant, client_id, record in self.store.clients():
            self._live.setdefault(tenant, OrderedDict())[client_id] = now
            self._clients[(tenant, client_id)] = record
        for prefix_hash, holders in self.store.location_items():
            self._locations[prefix_hash] = holders
            for replica, tier in holders.items():
                self._held.setdefault(replica, {})[prefix_hash] = {tier}
        if self.store.get_marker() is None:
            self.store.set_marker("kvflow-router")

    def reconcile(self) -> int:
        """Queue the router's whole durable state for the store (after an outage, or a store that lost
        data): templates, kept versions, live clients, locations and the marker. O(state), rare."""
        writes = 0
        for tenant, templates in self._templates.items():
            for name, template in templates.items():
                self.store.put_template(tenant, name, template.spec.to_dict(), ttl_s=self.template_ttl_s)
                writes += 1
        for (tenant, version), (_kept_at, spec) in self._old_versions.items():
            self.store.put_template(tenant, version, spec.to_dict(), ttl_s=self.store.ttl_s)
            writes += 1
        for (tenant, client_id), record in self._clients.items():
            self.store.put_client(tenant, client_id, record)
            writes += 1
        for prefix_hash, holders in self._locations.items():
            for replica, tier in holders.items():
                if prefix_hash in self._held.get(replica, {}):  # reported, not only foreseen
                    self.store.set_location(prefix_hash, replica, tier)
                    writes += 1
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
        self._outbox.pop(name, None)
        for replicas in self._told.values():
            replicas.discard(name)
        held = self._held.pop(name, {})
        for prefix_hash in held:
            holders = self._locations.get(prefix_hash, {})
            holders.pop(name, None)
            if not holders:
                self._locations.pop(prefix_hash, None)
        self.store.drop_replica(name, list(held))

    def cache_events(self, replica: str, events: Iterable[CacheEvent]) -> None:
        """Replica `replica` reports prefixes stored in / removed from a tier; the store keeps the best
        tier each replica holds each prefix in (device over host)."""
        held = self._held.setdefault(replica, {})
        for event in events:
            tiers = held.setdefault(event.prefix_hash, set())
            if event.kind == "stored":
                tiers.add(event.tier)
                self.fleet.blocks.stored(replica, event.tier, event.blocks)
            else:
                tiers.discard(event.tier)
                self.fleet.blocks.removed(replica, event.tier, event.blocks)
            best = "gpu" if "gpu" in tiers else "cpu" if "cpu" in tiers else None
            holders = self._locations.setdefault(event.prefix_hash, {})
            if best is None:
                del held[event.prefix_hash]
                holders.pop(replica, None)
                if not holders:
                    del self._locations[event.prefix_hash]
            else:
                holders[replica] = best
            self.store.set_location(event.prefix_hash, replica, best)

    # ------------------------------------------------------------------ templates
    def put_template(self, tenant: str, spec: Mapping[str, Any]) -> WorkflowSpec:
        """Register (or re-register) a template from the network: within the tenant's limits, and
        without touching the filesystem (`prompt_file` is refused). Re-sending the same spec (an
        inline `workflow_spec` on every call) writes nothing."""
        check_name("tenant", tenant)
        if self._write_tokens_left(tenant) < 1:  # a spent budget answers before any parsing
            try:
                return self._unchanged(tenant, spec)
            except KeyError:
                raise self._write_limit() from None
        parsed = parse_spec(dict(spec), limits=self.spec_limits)  # raises SpecError naming the field
        templates = self._templates.setdefault(tenant, OrderedDict())
        current = templates.get(parsed.name)
        if current is not None and current.spec.to_dict() == parsed.to_dict():
            current.sent = _digest(spec)
            self._use(tenant, current)
            return current.spec
        if current is None and len(templates) >= self.limits.max_templates:
            self._expire_templates(tenant)
            if len(templates) >= self.limits.max_templates:
                raise TenantLimitError("max_templates", f"tenant has {len(templates)} workflow templates, the "
                                                        "most allowed")
        self.store.check()
        self._take_write_token(tenant)
        if current is not None:  # live clients keep the version they started with (_spec_of)
            self.store.put_template(tenant, current.version, current.spec.to_dict(), ttl_s=self.store.ttl_s)
            self._remember_version(tenant, current.version, current.spec)
        now = time.monotonic()
        template = templates[parsed.name] = _Template(parsed, self._version_id(parsed), _digest(spec), now, now)
        templates.move_to_end(parsed.name)
        self.store.put_template(tenant, parsed.name, parsed.to_dict(), ttl_s=self.template_ttl_s)
        return template.spec

    @staticmethod
    def _version_id(spec: WorkflowSpec) -> str:
        """`name@digest`: the id of one version of a template (spec names never contain '@')."""
        return f"{spec.name}@{_digest(spec.to_dict()).hex()[:16]}"

    def _remember_version(self, tenant: str, version: str, spec: WorkflowSpec) -> None:
        self._old_versions[(tenant, version)] = (time.monotonic(), spec)
        self._old_versions.move_to_end((tenant, version))
        while len(self._old_versions) > OLD_VERSIONS_IN_MEMORY:
            self._old_versions.popitem(last=False)

    def _expire_versions(self) -> None:
        horizon = time.monotonic() - self.store.ttl_s
        while self._old_versions and next(iter(self._old_versions.values()))[0] < horizon:
            self._old_versions.popitem(last=False)

    def _spec_of(self, tenant: str, record: dict[str, Any]) -> WorkflowSpec:
        """The template version a client started with: the current one unless it changed since."""
        template = self._template(tenant, record["workflow"])
        version = record.get("version")
        if version is None or version == template.version:
            return template.spec
        kept = self._old_versions.get((tenant, version))
        old = kept[1] if kept is not None else None
        if old is None:  # beyond the memory bound: the store keeps it for the state TTL
            try:
                raw = self.store.get_template(tenant, version)
            except Exception:  # the store is down: the client runs on the current version
                raw = None
            if raw is None:
                return template.spec
            old = parse_spec(raw)
            self._remember_version(tenant, version, old)
        return old

    def _use(self, tenant: str, template: _Template) -> None:
        """A template was used: it is the tenant's most recent, and its store copy's idle TTL is renewed
        (at most every quarter TTL, so a hot template costs no write per call)."""
        now = time.monotonic()
        template.used_at = now
        self._templates[tenant].move_to_end(template.spec.name)
        if now - template.renewed_at > self.template_ttl_s / 4:
            template.renewed_at = now
            self.store.put_template(tenant, template.spec.name, template.spec.to_dict(), ttl_s=self.template_ttl_s)

    def _expire_templates(self, tenant: str) -> int:
        """Drop the tenant's templates unused for the template TTL (oldest first; O(what expired)). A
        client uses its template on every call and expires itself after the shorter state TTL, so no
        live client loses its template."""
        templates = self._templates.get(tenant)
        horizon = time.monotonic() - self.template_ttl_s
        expired = 0
        while templates:
            name, template = next(iter(templates.items()))
            if template.used_at > horizon:
                break
            del templates[name]
            self.store.delete_template(tenant, name)
            expired += 1
        return expired

    def _write_tokens_left(self, tenant: str) -> float:
        """The tenant's template-write bucket now (`template_writes_per_s`, `template_write_burst`)."""
        rate = self.limits.template_writes_per_s
        burst = float(self.limits.template_write_burst)
        now = time.monotonic()
        tokens, at = self._write_tokens.get(tenant, (burst, now))
        tokens = min(burst, tokens + (now - at) * rate)
        self._write_tokens[tenant] = (tokens, now)
        return tokens

    def _take_write_token(self, tenant: str) -> None:
        tokens = self._write_tokens_left(tenant)
        if tokens < 1:
            raise self._write_limit()
        self._write_tokens[tenant] = (tokens - 1, time.monotonic())

    def _write_limit(self) -> TenantLimitError:
        return TenantLimitError("template_writes_per_s", "workflow registrations are limited to "
                                f"{self.limits.template_writes_per_s:g} per second per tenant")

    def _unchanged(self, tenant: str, spec: Mapping[str, Any]) -> WorkflowSpec:
        """The registered template when `spec` is exactly what registered it (KeyError otherwise): no
        parsing, so a tenant out of write budget can still re-send what it registered."""
        name = spec.get("name")
        current = self._templates.get(tenant, {}).get(name) if isinstance(name, str) else None
        if current is None or current.sent != _digest(spec):
            raise KeyError(name)
        self._use(tenant, current)
        return current.spec

    def _template(self, tenant: str, name: str) -> _Template:
        check_name("workflow", name)
        template = self._templates.get(check_name("tenant", tenant), {}).get(name)
        if template is None:
            raise UnknownWorkflowError(f"unknown workflow {name!r} (register it with POST /v1/workflows)")
        self._use(tenant, template)
        return template

    def template(self, tenant: str, name: str) -> WorkflowSpec:
        return self._template(tenant, name).spec

    def client_workflow(self, tenant: str, client_id: str) -> str:
        """The workflow a live client runs (for requests that name only the client and agent)."""
        check_name("client_id", client_id)
        record = self._get_client(tenant, client_id)
        if record is None or (tenant, client_id) in self._finishing:
            raise UnknownClientError(f"unknown client {client_id!r}: its first request must name the workflow"
                                     + (" (it is finished; its last calls are completing)" if record else ""))
        return str(record["workflow"])

    # ------------------------------------------------------------------ calls
    def _get_client(self, tenant: str, client_id: str) -> dict[str, Any] | None:
        return self._clients.get((tenant, client_id))

    def _load_client(self, tenant: str, client_id: str) -> tuple[WorkflowSpec, WorkflowState, dict[str, Any]]:
        record = self._get_client(tenant, client_id)
        if record is None:
            raise UnknownClientError(f"unknown client {client_id!r}: start it with a request that names its workflow")
        spec = self._spec_of(tenant, record)
        return spec, WorkflowState.from_dict(spec, record["state"]), record

    def _save_client(self, tenant: str, client_id: str, spec: WorkflowSpec, state: WorkflowState,
                     record: dict[str, Any]) -> None:
        record["workflow"] = spec.name
        record["state"] = state.to_dict()
        self.store.put_client(tenant, client_id, record)
        self._clients[(tenant, client_id)] = record

    def start_call(self, tenant: str, client_id: str, agent: str, *, workflow: str | None = None,
                   prefix_hash: str | None = None, prefix_tokens: int = 0, cache_salt: str = "",
                   retry: bool = False, tokens: Sequence[int] = (), max_new: int = 0) -> Route:
        """An agent call arrives: update the client's state, pick a replica, compute the hints.
        `cache_salt`: the cache namespace of the tenant's requests (the engines' prompts for prefetch
        live there); `prefix_hash` is already salted. Every check runs before any state changes.
        `retry`: the same call again, after its replica died under it (one end_call ends both).
        `tokens` / `max_new`: the prompt's token ids and output budget, for policies that read them
        (prefix trees, block look-ups); without them a policy prices the fixed prompt alone."""
        started = time.perf_counter()
        self.calls["start_call"] += 1
        check_name("client_id", client_id)
        self.store.check()
        if (tenant, client_id) in self._finishing:
            raise UnknownClientError(f"unknown client {client_id!r}: it is finished (its last calls are completing)")
        record = self._get_client(tenant, client_id)
        if record is None or (workflow is not None and record["workflow"] != workflow):
            if workflow is None:
                raise UnknownClientError(f"unknown client {client_id!r}: its first request must name the workflow")
            template = self._template(tenant, workflow)
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
        self._touch_live(tenant, client_id)
        record["salt"] = cache_salt
        deviation = not (agent in state.running or state.ready(agent) or (fresh and agent in spec.start_agents()))
        if deviation:
            self.deviations += 1
        self._learn(tenant, spec, state, record, agent)
        state.start(agent)
        request = RouteRequest(tokens, cache_salt, prefix_hash, prefix_tokens,
                               self._holders(prefix_hash) if prefix_hash else {}, record.get("home"), max_new,
                               group=application_key(tenant, spec.name))
        asked = time.perf_counter()
        decision = self.policy.route(request, self.fleet)
        self.policy_seconds.append(time.perf_counter() - asked)
        self.policy.routed(request, decision.replica)
        routed = self._routed.setdefault((tenant, client_id), [])
        if retry:  # the call's entry on the replica that died goes (the policy has forgotten that replica)
            routed[:] = [entry for entry in routed if entry[0] != agent or entry[1] in self.loads]
        routed.append((agent, decision.replica, request))
        record["placement"][agent] = decision.replica
        record["home"] = decision.replica
        if prefix_hash:  # where this agent's prompt lives next time: for prefetch hints (below)
            record.setdefault("prefixes", {})[agent] = [prefix_hash, prefix_tokens]
        if prefix_hash and decision.tier is None:
            # The chosen replica will hold the prefix once this call's prefill runs: say so now, so
            # calls for the same prefix that arrive before its cache event follow it there instead
            # of computing a second copy elsewhere. (Memory only: the store keeps what replicas report.)
            self._locations.setdefault(prefix_hash, {})[decision.replica] = "gpu"
        self._save_client(tenant, client_id, spec, state, record)
        self.loads[decision.replica] += 1
        if not retry:
            self._calls[(tenant, client_id)] += 1
        self.decisions[decision.outcome] += 1
        key = workflow_key(tenant, client_id)
        route = Route(decision.replica, decision.outcome, key, spec.agents[agent].prompt, deviation,
                      self._hints(tenant, key, state, spec, record))
        self._record_latency(time.perf_counter() - started)
        return route

    def end_call(self, tenant: str, client_id: str, agent: str, replica: str | None = None) -> list[tuple[str, Hints]]:
        """The call finished (served or failed): the agent is done; new steps go to the replicas. A
        client finished (or expired) meanwhile costs the call nothing: it still returns its answer,
        and a finished client retires once its last call has ended."""
        self.calls["end_call"] += 1
        if replica is not None and self.loads.get(replica, 0) > 0:
            self.loads[replica] -= 1
        call = self._take_routed(tenant, client_id, agent, replica)
        if call is not None:
            self.policy.ended(call[2], call[1])
        client = (tenant, client_id)
        if self._calls[client] > 1:
            self._calls[client] -= 1
        else:
            self._calls.pop(client, None)
        if client in self._finishing:
            return self._finish(tenant, client_id) if client not in self._calls else []
        record = self._get_client(tenant, client_id)
        if record is None:
            return []
        spec, state, record = self._load_client(tenant, client_id)
        if agent not in spec.agents:
            raise UnknownAgentError(agent, spec.name, spec.agents)
        state.finish(agent)
        self._save_client(tenant, client_id, spec, state, record)
        self._touch_live(tenant, client_id, admit=False)
        return self._hints(tenant, workflow_key(tenant, client_id), state, spec, record)

    def prefilled(self, tenant: str, client_id: str, agent: str, replica: str) -> None:
        """The call's first token came back (its prompt is computed): for policies that count
        prefill work in flight (Dynamo's)."""
        for entry in self._routed.get((tenant, client_id), ()):
            if entry[0] == agent and entry[1] == replica:
                self.policy.prefilled(entry[2], replica)
                return

    def first_tokens(self, replica: str, calls: Iterable[tuple[str, str]]) -> None:
        """`replica` sent the first token of these calls ((workflow key, agent) each, as the engine
        request names them): `prefilled` for each."""
        for key, agent in calls:
            self.calls["first_token"] += 1
            tenant, _, client_id = key.partition("/")
            self.prefilled(tenant, client_id, agent, replica)

    def _take_routed(self, tenant: str, client_id: str, agent: str,
                     replica: str | None) -> tuple[str, str, RouteRequest] | None:
        """The oldest call in flight of `agent` (on `replica` when given), no longer in flight."""
        routed = self._routed.get((tenant, client_id))
        if not routed:
            return None
        for i, entry in enumerate(routed):
            if entry[0] == agent and (replica is None or entry[1] == replica):
                del routed[i]
                if not routed:
                    del self._routed[(tenant, client_id)]
                return entry
        return None

    def finish_client(self, tenant: str, client_id: str) -> list[tuple[str, Hints]]:
        """`POST /v1/clients/{id}/finish`: the workflow instance is over; its prompts are retired, at
        once, or when its calls still running have ended."""
        started, started_cpu = time.perf_counter(), time.thread_time()
        self.calls["finish_client"] += 1
        check_name("client_id", client_id)
        self.store.check()
        client = (tenant, client_id)
        if client in self._finishing:
            return []
        if self._get_client(tenant, client_id) is None:
            raise UnknownClientError(f"unknown client {client_id!r}")
        if client in self._calls:
            self._finishing.add(client)
            return []
        hints = self._finish(tenant, client_id)
        self.finish_seconds.append(time.perf_counter() - started)
        self.finish_cpu_seconds.append(time.thread_time() - started_cpu)
        return hints

    def _finish(self, tenant: str, client_id: str) -> list[tuple[str, Hints]]:
        self._finishing.discard((tenant, client_id))
        self.store.delete_client(tenant, client_id)
        return self._forget_client(tenant, client_id)

    def _forget_client(self, tenant: str, client_id: str) -> list[tuple[str, Hints]]:
        """Everything the router holds for a client that is over (finished or expired), O(replicas):
        its cached record, its live entry, what replicas were told; and a retire hint for every
        replica, so their books and tags let go of it too."""
        self._clients.pop((tenant, client_id), None)
        self._routed.pop((tenant, client_id), None)
        self._live.get(tenant, OrderedDict()).pop(client_id, None)
        key = workflow_key(tenant, client_id)
        told = self._told.pop(key, None)
        replicas = sorted(self.loads if told is None else told & self.loads.keys())
        for replica in replicas:
            batch = self._outbox.setdefault(replica, HintBatch())
            batch.steps.pop(key, None)
            batch.prompts.pop(key, None)
            batch.elsewhere.pop(key, None)
            batch.salts.pop(key, None)
            batch.retire.append(key)
        retire = Hints(retire=[key])
        return [(replica, retire) for replica in replicas]

    def expire(self) -> int:
        """Retire every client idle for longer than the state TTL (its store entry expires by the same
        TTL) and drop templates unused for the template TTL; O(tenants + what expired). The router
        actor calls it once a second. How many clients expired."""
        for tenant in list(self._templates):
            self._expire_templates(tenant)
        self._expire_versions()
        return sum(self._expire_live(tenant) for tenant in list(self._live))

    def sizes(self) -> dict[str, int]:
        """How much state the router holds (a soak watches these stay bounded)."""
        return {"live_clients": len(self._clients), "templates": sum(map(len, self._templates.values())),
                "old_versions": len(self._old_versions), "locations": len(self._locations),
                "told": len(self._told), "outbox": sum(len(b.steps) + len(b.retire) for b in self._outbox.values()),
                "calls_in_flight": len(self._calls)}

    def take_hints(self, replica: str) -> HintBatch | None:
        """The hints waiting for `replica` (removed from the outbox), or None."""
        batch = self._outbox.pop(replica, None)
        return batch if batch else None

    def pending_hints(self) -> list[str]:
        return [replica for replica, batch in self._outbox.items() if batch]

    def has_hints(self, replica: str) -> bool:
        return bool(self._outbox.get(replica))

    def active_clients(self) -> Counter[str]:
        """Live workflow instances per tenant (the `kvflow_workflows_active` gauge), from memory:
        O(tenants + what expired since the last count), never a store scan."""
        for tenant in list(self._live):
            self._expire_live(tenant)
        return Counter({tenant: len(live) for tenant, live in self._live.items() if live})

    def _touch_live(self, tenant: str, client_id: str, admit: bool = True) -> None:
        """Count activity of a live client; with `admit`, a new one must fit within the tenant's limit."""
        live = self._live.setdefault(tenant, OrderedDict())
        if admit and client_id not in live:
            self._expire_live(tenant)
            if len(live) >= self.limits.max_live_clients:
                raise TenantLimitError("max_live_clients", f"tenant has {len(live)} live workflow clients, the most "
                                                           "allowed; finish some (POST /v1/clients/{id}/finish)")
        live[client_id] = time.monotonic()
        live.move_to_end(client_id)

    def _expire_live(self, tenant: str) -> int:
        """Forget the tenant's clients idle past the TTL (oldest first); how many there were."""
        live = self._live[tenant]
        horizon = time.monotonic() - self.store.ttl_s
        expired = 0
        while live:
            client_id, at = next(iter(live.items()))
            if at > horizon or (tenant, client_id) in self._calls:
                break
            self._forget_client(tenant, client_id)
            expired += 1
        return expired

    # ------------------------------------------------------------------ helpers
    def _holders(self, prefix_hash: str) -> dict[str, str]:
        return self._locations.get(prefix_hash, {})

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
                             ttl_s=self.template_ttl_s)

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
        them; once told, a replica hears every update until the instance retires. So a call costs
        O(the replicas the workflow touches), not O(fleet). Every other told replica hears that an
        upcoming agent runs `elsewhere`: it ranks the agent's prompt by its steps but does not load
        it. A replica learns the agents' prompts the first time it hears of the instance."""
        steps = self.forecast.steps(tenant, spec.name, state, record.get("history") or ())
        targets = self._prefetch_targets(steps, record, application_key(tenant, spec.name))
        salt = str(record.get("salt", ""))
        told = self._told.setdefault(key, set())
        new = {*record["placement"].values(), *targets.values()} - told
        told |= new & self.loads.keys()
        prompts = {agent: a.prompt for agent, a in spec.agents.items() if a.prompt} if new else {}
        everywhere_else = sorted(targets)
        out = []
        for replica in sorted(told & self.loads.keys()):
            batch = self._outbox.setdefault(replica, HintBatch())
            if replica in new and prompts:  # its first time: the prompts, in their namespace
                batch.prompts[key] = prompts
                batch.salts[key] = salt
            elsewhere = (everywhere_else if replica not in targets.values()
                         else sorted(agent for agent, target in targets.items() if target != replica))
            batch.steps[key] = steps
            if elsewhere:
                batch.elsewhere[key] = elsewhere
            else:
                batch.elsewhere.pop(key, None)
            out.append((replica, Hints(steps={key: steps}, salts={key: salt}, elsewhere={key: elsewhere})))
        return out

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
            holders = self._holders(prefix_hash) if prefix_hash else {}
            ask = RouteRequest(prefix_hash=prefix_hash, prefix_tokens=tokens, holders=holders, home=home, group=group)
            targets[agent] = self.policy.route(ask, self.fleet).replica
        return targets

    def _record_latency(self, seconds: float) -> None:
        self.decision_seconds.append(seconds)
