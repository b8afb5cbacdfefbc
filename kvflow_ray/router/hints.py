"""The hints each replica is owed: per replica, an outbox merging what is still to send (the steps of
each workflow instance, the prompts of instances it has not heard of, retirements), and per
instance, which replicas hear of it. Replicas take their batch by long poll."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kvflow_ray.engines.base import Hints


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


class HintOutbox:
    def __init__(self) -> None:
        self._outbox: dict[str, HintBatch] = {}  # replica -> hints not yet taken
        # workflow key -> the replicas that hear of it (its steps, prompts, retirement): those it ran on or
        # will be routed to; absent (a new instance, or after a restart): not known, retire everywhere
        self._told: dict[str, set[str]] = {}

    def update(self, key: str, steps: dict[str, float], salt: str, concerned: Collection[str],
               targets: Mapping[str, str], prompts: Callable[[], dict[str, str]],
               live: AbstractSet[str]) -> list[tuple[str, Hints]]:
        """New steps-to-execution of instance `key` for the replicas it concerns: `concerned` (those it
        ran on, and `targets`, where its upcoming agents will be routed: agent -> replica); once told, a
        replica hears every update until the instance retires. So a call costs O(the replicas the
        instance touches), not O(fleet). Every other told replica hears that an upcoming agent runs
        `elsewhere`: it ranks the agent's prompt by its steps but does not load it. A replica gets the
        agents' prompts (`prompts()`, built only then) the first time it hears of the instance.
        `live`: the replicas that exist now."""
        told = self._told.setdefault(key, set())
        new = {*concerned, *targets.values()} - told
        told |= new & live
        texts = prompts() if new else {}
        everywhere_else = sorted(targets)
        out = []
        for replica in sorted(told & live):
            batch = self._outbox.setdefault(replica, HintBatch())
            if replica in new:  # its first time: the instance's namespace, and the prompts when known
                batch.salts[key] = salt
                if texts:
                    batch.prompts[key] = texts
            elsewhere = (everywhere_else if replica not in targets.values()
                         else sorted(agent for agent, target in targets.items() if target != replica))
            batch.steps[key] = steps
            if elsewhere:
                batch.elsewhere[key] = elsewhere
            else:
                batch.elsewhere.pop(key, None)
            out.append((replica, Hints(steps={key: steps}, salts={key: salt}, elsewhere={key: elsewhere})))
        return out

    def retire(self, key: str, live: AbstractSet[str]) -> list[tuple[str, Hints]]:
        """Instance `key` is over: every replica that heard of it (every live one when that is not
        known) is told to retire it, and nothing else of it waits in their outboxes."""
        told = self._told.pop(key, None)
        replicas = sorted(live if told is None else told & live)
        for replica in replicas:
            batch = self._outbox.setdefault(replica, HintBatch())
            batch.steps.pop(key, None)
            batch.prompts.pop(key, None)
            batch.elsewhere.pop(key, None)
            batch.salts.pop(key, None)
            batch.retire.append(key)
        retire = Hints(retire=[key])
        return [(replica, retire) for replica in replicas]

    def merge(self, replica: str, batch: HintBatch) -> None:
        """Add a batch made elsewhere (an ingress replica's outbox) to what waits for `replica`, as if
        its updates had been made here after what waits: a retirement drops what waits of the
        instance, later steps replace earlier ones. Instances are per client and a client is routed
        by one ingress, so batches of different ingresses never touch the same instance."""
        waiting = self._outbox.setdefault(replica, HintBatch())
        for key in batch.retire:
            for part in (waiting.steps, waiting.prompts, waiting.salts, waiting.elsewhere):
                part.pop(key, None)
            waiting.retire.append(key)
        waiting.steps.update(batch.steps)
        waiting.prompts.update(batch.prompts)
        waiting.salts.update(batch.salts)
        for key in batch.steps:
            if key in batch.elsewhere:
                waiting.elsewhere[key] = batch.elsewhere[key]
            else:
                waiting.elsewhere.pop(key, None)

    def take(self, replica: str) -> HintBatch | None:
        """The hints waiting for `replica` (removed from the outbox), or None."""
        batch = self._outbox.pop(replica, None)
        return batch if batch else None

    def pending(self) -> list[str]:
        return [replica for replica, batch in self._outbox.items() if batch]

    def has(self, replica: str) -> bool:
        return bool(self._outbox.get(replica))

    def told(self, key: str) -> bool:
        return key in self._told

    def forget(self, key: str) -> None:
        """Instance `key` is routed elsewhere now: which replicas heard of it is the new router's
        to learn (not knowing, it retires the instance everywhere)."""
        self._told.pop(key, None)

    def drop(self, replica: str) -> None:
        """`replica` left: nothing waits for it, and no instance counts it as told (O(instances), rare)."""
        self._outbox.pop(replica, None)
        for replicas in self._told.values():
            replicas.discard(replica)

    def sizes(self) -> dict[str, int]:
        return {"told": len(self._told), "outbox": sum(len(b.steps) + len(b.retire) for b in self._outbox.values())}
