"""The router actor and its ingress replicas without Ray (`router/peers.py`): a hub core that hears the
replicas, ingress cores that route on their own and stay in step through syncs."""

from __future__ import annotations

import dataclasses

import pytest

from kvflow_ray.core.routing import RouteRequest, _rank, block_hashes
from kvflow_ray.engines.base import CacheEvent
from kvflow_ray.router.core import RouterCore, TenantLimitError
from kvflow_ray.router.hints import HintBatch, HintOutbox
from kvflow_ray.router.limits import TenantLimits
from kvflow_ray.router.peers import HubLink, Peers
from kvflow_ray.router.store import MemoryStore
from kvflow_ray.serve.metrics import merge_expositions

PEER = {"name": "peer", "entry": "planner", "agents": {
    "planner": {"prompt": "You are the Planner.", "after": ["reviewer"]},
    "executor": {"after": ["planner"]},
    "expresser": {"after": ["executor"]},
    "reviewer": {"after": ["expresser"]},
}}
HUB = "hub-1"


class Fleet:
    """A hub core, its peers, and the calls the router actor makes on them (what `router_actor.py`
    does around them is Ray)."""

    def __init__(self, limits: TenantLimits | None = None, max_queued: int = 20_000) -> None:
        self.limits = limits or TenantLimits()
        self.hub = RouterCore(MemoryStore(), limits=self.limits)
        self.peers = Peers(max_queued=max_queued)
        for replica in ("r1", "r2"):
            self.hub.add_replica(replica)
        self.hub.put_template("acme", PEER)

    def two_ingresses(self) -> tuple[HubLink, HubLink]:
        """Ingresses "A" and "B", each synced once (both know the fleet)."""
        a, b = self.ingress(), self.ingress()
        self.sync(a, "A")
        self.sync(b, "B")
        return a, b

    def ingress(self, store: MemoryStore | None = None) -> HubLink:
        link = HubLink(RouterCore(store or MemoryStore(), limits=self.limits, owner=False))
        exported = self.hub.templates.exported("acme", "peer")
        link.core.templates.adopt("acme", exported["spec"], exported["version"])
        return link

    def sync(self, link: HubLink, name: str) -> list[tuple[str, str]]:
        self.peers.heard(self.hub, name, link.outbound())  # the actor's sync, not held
        return link.apply(self.peers.reply(self.hub, HUB, name))

    def events(self, replica: str, events: list[CacheEvent]) -> None:
        self.hub.cache_events(replica, events)
        self.peers.publish(("events", replica, [dataclasses.astuple(e) for e in events]))

    def first(self, replica: str, calls: list[tuple[str, str, int]]) -> None:
        """`replica` reports these calls' first tokens, as the actor's `cache_events` passes them on."""
        self.hub.first_tokens(replica, calls)
        self.peers.publish(("first", replica, [list(call) for call in calls]))


def stored(prefix: str, tokens: list[int], tier: str = "gpu") -> CacheEvent:
    return CacheEvent("stored", tier, prefix, len(tokens), tuple(block_hashes(tokens, "")))


def test_an_ingress_routes_on_what_the_replicas_reported_to_the_hub() -> None:
    fleet = Fleet()
    a = fleet.ingress()
    fleet.sync(a, "A")
    assert set(a.core.loads) == {"r1", "r2"} and a.hub == HUB
    fleet.events("r2", [stored("hp", list(range(64)))])
    fleet.sync(a, "A")
    assert a.core.holdings.holders("hp") == {"r2": "gpu"}
    route = a.core.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="hp", prefix_tokens=64)
    assert route.replica == "r2" and route.outcome == "affinity"
    assert fleet.hub.take_hints("r2") is None  # the hints leave with the next sync, not before
    fleet.sync(a, "A")
    assert fleet.hub.take_hints("r2").steps["acme/c1"]["planner"] == 0


def test_every_ingress_counts_the_others_calls_in_flight() -> None:
    fleet = Fleet()
    a, b = fleet.two_ingresses()
    route = a.core.start_call("acme", "c1", "planner", workflow="peer")
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    assert b.core.loads[route.replica] == 1 and a.core.loads[route.replica] == 1
    b.core.start_call("acme", "c2", "planner", workflow="peer")
    fleet.sync(b, "B")
    fleet.sync(a, "A")
    assert sum(a.core.loads.values()) == 2 and a.own_loads() == {route.replica: 1}
    a.core.end_call("acme", "c1", "planner", route.replica)
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    assert sum(b.core.loads.values()) == 1 and sum(a.core.loads.values()) == 1
    assert fleet.peers.totals()["calls_in_flight"] == 1
    assert sum(fleet.peers.load(r) for r in ("r1", "r2")) == 1  # b's call, as b last said
    # an ingress that stops syncing stops counting
    fleet.peers.silent_s = 0.0
    assert set(fleet.peers.prune()) == {"A", "B"}
    fleet.sync(a, "A")
    assert sum(a.core.loads.values()) == 0


def test_the_live_client_limit_counts_every_ingress() -> None:
    fleet = Fleet(TenantLimits(max_live_clients=1))
    a, b = fleet.ingress(), fleet.ingress()
    fleet.sync(a, "A")
    a.core.start_call("acme", "c1", "planner", workflow="peer")
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    with pytest.raises(TenantLimitError, match="1 live workflow clients"):
        b.core.start_call("acme", "c2", "planner", workflow="peer")


def test_a_new_ingress_starts_from_the_hubs_holdings() -> None:
    fleet = Fleet(max_queued=2)
    a = fleet.ingress()
    fleet.sync(a, "A")
    tokens = list(range(48))
    fleet.events("r1", [stored("h1", tokens), stored("h1", tokens, "cpu")])
    fleet.events("r2", [stored("h2", tokens, "cpu")])
    fleet.sync(a, "A")  # the events, in order
    late = fleet.ingress()
    fleet.sync(late, "late")  # the whole holdings
    for link in (a, late):
        assert link.core.holdings.holders("h1") == {"r1": "gpu"} and link.core.holdings.holders("h2") == {"r2": "cpu"}
        assert link.core.fleet.blocks.export() == fleet.hub.fleet.blocks.export()
    # a queue that overflows (an ingress that did not sync for long) is replaced by the holdings
    for i in range(3):
        fleet.events("r2", [stored(f"x{i}", [i] * 16)])
    assert fleet.peers.peers["A"].owes_snapshot
    fleet.sync(a, "A")
    assert a.core.holdings.holders("x2") == {"r2": "gpu"} and len(a.core.holdings) == len(fleet.hub.holdings)


def test_replicas_the_hub_forgets_leave_every_ingress() -> None:
    fleet = Fleet()
    a = fleet.ingress()
    fleet.sync(a, "A")
    fleet.hub.fleet.report("r1", usage=0.5, waiting=3, capacity=1000)
    fleet.hub.remove_replica("r2")
    fleet.sync(a, "A")
    assert set(a.core.loads) == {"r1"} and a.core.fleet.capacity == {"r1": 1000} and a.core.fleet.waiting["r1"] == 3


def test_a_failed_sync_keeps_its_hints_for_the_next() -> None:
    fleet = Fleet()
    a = fleet.ingress()
    fleet.sync(a, "A")
    route = a.core.start_call("acme", "c1", "planner", workflow="peer")
    lost = a.outbound()
    assert lost["hints"] and not a.core.pending_hints()
    a.unsent(lost)
    fleet.sync(a, "A")
    assert "acme/c1" in fleet.hub.take_hints(route.replica).steps


def test_a_client_another_ingress_routed_is_recalled_from_a_shared_store() -> None:
    fleet = Fleet()
    shared = MemoryStore()
    a, b = fleet.ingress(shared), fleet.ingress(shared)
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    route = a.core.start_call("acme", "c1", "planner", workflow="peer")
    a.core.end_call("acme", "c1", "planner", route.replica)
    assert b.core.clients.get("acme", "c1") is None
    b.core.clients.adopt("acme", "c1", shared.get_client("acme", "c1"))
    b.claim("acme", "c1")  # what the ingress does when it recalls one
    assert b.core.client_workflow("acme", "c1") == "peer"
    assert not b.core.start_call("acme", "c1", "executor").deviation  # its step graph came with it
    # the ingress that routed it before lets go (without retiring it: it goes on at b)
    fleet.sync(b, "B")
    fleet.sync(a, "A")
    assert a.core.clients.get("acme", "c1") is None
    fleet.sync(a, "A")  # ... and says so with its next
    assert fleet.peers.totals()["live_clients"] == 1
    assert b.core.clients.get("acme", "c1") is not None and not a.core.pending_hints()


def test_a_changed_template_reaches_every_ingress_and_old_clients_keep_theirs() -> None:
    fleet = Fleet()
    a = fleet.ingress()
    fleet.sync(a, "A")
    a.core.start_call("acme", "old", "planner", workflow="peer")
    changed = {**PEER, "agents": {**PEER["agents"], "critic": {"after": ["reviewer"]}}}
    fleet.hub.put_template("acme", changed)
    fleet.peers.publish(("template", "acme", "peer"))  # what the actor does when a version changes
    assert fleet.sync(a, "A") == [("acme", "peer")]
    exported = fleet.hub.templates.exported("acme", "peer")
    a.core.templates.adopt("acme", exported["spec"], exported["version"])
    assert "critic" in a.core.template("acme", "peer").agents
    a.core.start_call("acme", "new", "critic", workflow="peer")
    with pytest.raises(ValueError, match="critic"):  # the old client runs the version it started on
        a.core.start_call("acme", "old", "critic")
    # the templates an ingress used stay alive at the hub
    used = a.core.templates.take_used()
    assert used == [("acme", "peer")] and a.core.templates.take_used() == []


def test_merged_hints_read_as_if_made_in_order() -> None:
    outbox = HintOutbox()
    outbox.merge("r1", HintBatch(steps={"t/a": {"x": 1.0}, "t/b": {"y": 2.0}}, prompts={"t/a": {"x": "p"}},
                                 salts={"t/a": "s"}, elsewhere={"t/a": ["x"]}))
    outbox.merge("r1", HintBatch(steps={"t/a": {"x": 0.0}}, retire=["t/b"]))
    batch = outbox.take("r1")
    assert batch.steps == {"t/a": {"x": 0.0}} and batch.retire == ["t/b"]
    assert batch.prompts == {"t/a": {"x": "p"}} and batch.elsewhere == {}  # the later steps said nowhere else


def test_each_ingress_metrics_keep_their_own_label() -> None:
    text = b"# HELP kvflow_router_decisions_total d\n# TYPE kvflow_router_decisions_total counter\n" \
           b'kvflow_router_decisions_total{outcome="affinity"} 3.0\n'
    merged = merge_expositions([(text, {"ingress": "a"}), (text, {"ingress": "b"})]).decode()
    assert 'kvflow_router_decisions_total{ingress="a",outcome="affinity"} 3.0' in merged
    assert 'kvflow_router_decisions_total{ingress="b",outcome="affinity"} 3.0' in merged
    assert merged.count("# TYPE kvflow_router_decisions_total") == 1


def test_the_workflow_router_prices_the_other_ingresses_work_in_flight() -> None:
    fleet = Fleet()
    a, b = fleet.two_ingresses()
    first = a.core.start_call("acme", "c1", "planner", workflow="peer", tokens=list(range(2048)), max_new=8)
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    assert b.core.policy.work.prefill_tokens(first.replica) == 2048  # a's prompt, still to prefill there
    # another application's call at b goes where no prefill waits, as one router would send it
    other = b.core.start_call("acme", "c2", "planner", workflow="peer", tokens=list(range(5000, 7048)), max_new=8)
    assert other.replica != first.replica
    a.core.end_call("acme", "c1", "planner", first.replica)
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    assert b.core.policy.work.prefill_tokens(first.replica) == 0


def test_another_ingresss_call_stops_counting_as_prefill_when_its_first_token_comes() -> None:
    """Every ingress prices the prompt another ingress's call still prefills on a replica, from that
    ingress's last sync; the replica's report of the call's first token, which every ingress hears,
    retires it at once, before its own ingress says so."""
    fleet = Fleet()
    a, b = fleet.two_ingresses()
    route = a.core.start_call("acme", "c1", "planner", workflow="peer", tokens=list(range(64)), max_new=8)
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    theirs = b.core.policy.work
    assert theirs.prefill_tokens(route.replica) == 64 and theirs.blocks(route.replica) == 4
    fleet.first(route.replica, [(route.workflow_key, "planner", route.call)])
    fleet.sync(b, "B")  # a has not synced since: its word still lists the call
    assert theirs.prefill_tokens(route.replica) == 0 and theirs.blocks(route.replica) == 4
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    assert a.core.policy.work.prefill_tokens(route.replica) == theirs.prefill_tokens(route.replica) == 0
    a.core.end_call("acme", "c1", "planner", route.replica)
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    assert theirs.blocks(route.replica) == 0


def test_a_prompt_one_ingress_just_sent_is_followed_by_the_others() -> None:
    """Before the replica's cache event comes, the other ingresses count the replica an ingress just
    sent a prompt to as its holder, as that ingress does (one copy of the prompt, not one per ingress)."""
    fleet = Fleet()
    a, b = fleet.two_ingresses()
    route = a.core.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="hp", prefix_tokens=512)
    assert a.core.holdings.holders("hp") == {route.replica: "gpu"}
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    assert b.core.holdings.holders("hp") == {route.replica: "gpu"}
    assert b.core.start_call("acme", "c2", "planner", workflow="peer", prefix_hash="hp",
                             prefix_tokens=512).replica == route.replica
    assert b.core.holdings.take_foreseen() == []  # what came from a is not sent back


def test_a_new_placement_is_news_for_the_other_ingresses_and_cache_events_are_not() -> None:
    """The actor holds an ingress's sync until something urgent is queued for it: a prompt another
    ingress just sent to a replica ends it at once; the replicas' cache events wait for the next."""
    fleet = Fleet()
    a, b = fleet.two_ingresses()
    assert not fleet.peers.news("A") and not fleet.peers.news("B")
    fleet.events("r1", [stored("hx", list(range(64)))])
    assert not fleet.peers.news("B")  # queued, not urgent
    assert not a.news()
    a.core.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="hp", prefix_tokens=512)
    assert a.news()  # a prompt sent where nobody held it: a ends its held sync to send it up
    assert fleet.peers.heard(fleet.hub, "A", a.outbound()) == ["B"]  # b's held sync ends
    assert fleet.peers.news("B") and not fleet.peers.news("A")  # a's own news is not sent back to it
    a.apply(fleet.peers.reply(fleet.hub, HUB, "A"))
    fleet.sync(b, "B")
    assert not fleet.peers.news("B")
    assert b.core.holdings.holders("hp") and b.core.holdings.holders("hx") == {"r1": "gpu"}


def test_ingresses_agree_on_each_applications_home_and_count_its_pressure() -> None:
    """Two ingresses whose first calls of one application crossed (each placed it on another replica)
    converge on one home after a sync each; and an application busy at one counts toward the memory
    pressure every ingress sees."""
    fleet = Fleet()
    a, b = fleet.two_ingresses()
    for link in (a, b):
        link.core.fleet.report("r1", usage=0.0, waiting=0, capacity=1000)
        link.core.fleet.report("r2", usage=0.0, waiting=0, capacity=1000)
    first = a.core.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="hp", prefix_tokens=512)
    group = "acme/peer"
    crossed = RouteRequest(prefix_hash="hp", prefix_tokens=512, group=group)
    elsewhere = "r2" if first.replica == "r1" else "r1"
    b.core.policy.apps.routed(crossed, elsewhere, rehome=False)  # b placed the application elsewhere meanwhile
    assert a.core.policy.apps.home(group) != b.core.policy.apps.home(group)
    fleet.sync(a, "A")
    fleet.sync(b, "B")
    fleet.sync(a, "A")
    assert a.core.policy.apps.home(group) == b.core.policy.apps.home(group) == "r1"  # a tie: the first by name
    # a's call is in flight: its application's working set is hot at b too (2,000 tokens of device KV)
    b.core.policy.apps.ended(crossed, elsewhere)
    fleet.sync(b, "B")
    assert b.core.policy.apps.pressure(b.core.fleet) == 512 / 2000


def test_two_applications_placed_together_at_once_are_spread_over_the_fleet() -> None:
    """Two ingresses each placed a different new application at the same moment, on the same replica
    (their rendezvous ranks agree), while another replica is home to no busy application: after a
    sync each, both ingresses move the same one of them to the empty replica."""
    fleet = Fleet()
    a, b = fleet.two_ingresses()
    x = RouteRequest(prefix_hash="hx", prefix_tokens=512, group="acme/x")
    y = RouteRequest(prefix_hash="hy", prefix_tokens=512, group="acme/y")
    a.core.policy.apps.routed(x, "r1", rehome=False)
    b.core.policy.apps.routed(y, "r1", rehome=False)
    for link, name in ((a, "A"), (b, "B"), (a, "A")):
        fleet.sync(link, name)
    mover = min(("acme/x", "acme/y"), key=lambda group: (_rank(group, "r2"), group))
    assert a.core.policy.apps.home("acme/x") == ("r2" if mover == "acme/x" else "r1")
    assert b.core.policy.apps.home("acme/y") == ("r2" if mover == "acme/y" else "r1")
    b.core.policy.apps.routed(x, "r1", rehome=False)  # a call of x at b, placed before b heard: the vote moves it
    for link, name in ((b, "B"), (a, "A"), (b, "B")):
        fleet.sync(link, name)
    assert a.core.policy.apps.home("acme/x") == b.core.policy.apps.home("acme/x") != b.core.policy.apps.home("acme/y")


def test_an_application_placed_apart_goes_home_where_fewer_applications_live() -> None:
    """Two ingresses placed a new application at once, one beside another application and one on an
    empty replica: the vote is a tie, and both move it to the replica fewer applications call home
    (the first by name would stack the two applications on one replica)."""
    fleet = Fleet()
    a, b = fleet.two_ingresses()
    other = RouteRequest(prefix_hash="ho", prefix_tokens=512, group="acme/other")
    new = RouteRequest(prefix_hash="hn", prefix_tokens=512, group="acme/new")
    for link in (a, b):
        link.core.policy.apps.routed(other, "r1", rehome=False)  # both know acme/other lives on r1
    a.core.policy.apps.routed(new, "r1", rehome=False)  # a placed acme/new beside it ...
    b.core.policy.apps.routed(new, "r2", rehome=False)  # ... b on the empty replica
    for link, name in ((a, "A"), (b, "B"), (a, "A"), (b, "B")):
        fleet.sync(link, name)
    assert a.core.policy.apps.home("acme/new") == b.core.policy.apps.home("acme/new") == "r2"
    assert a.core.policy.apps.home("acme/other") == b.core.policy.apps.home("acme/other") == "r1"
