"""Prediction: how far each agent of a live workflow instance is from running, as the cache policies
read it (a `StepBook`'s steps). One small strategy per way of predicting, selected by registry:

- `graph`: `WorkflowState.steps_to_execution`, the step graph alone (KVFlow; every alternative of a
  `next: one` agent one step away);
- `priors`: `WorkflowState.expected_steps` under the spec's weights;
- `learned`: `expected_steps` under a `TransitionModel` learned from the calls routed so far (PBKV's
  idea: the history of which agent followed which predicts the next ones), fused with the spec's
  weights and starting cold from them.

The model counts, per tenant and template, which successor each `next: one` agent handed over to, in
two contexts: the agent alone, and the agent with the agent before it and how often it has run in
this instance (which separates a loop's first pass from its later ones). Estimates back off from the
narrow context to the agent's, and from that to the spec's weights (Dirichlet smoothing with
`prior_strength` pseudo-counts). Counts decay by `decay` per observation of their context, so the
model follows a drifting mix within a few tens of instances. Bounded: at most `max_contexts`
contexts (least recently used go first). Pure data: `to_dict` / `from_dict` persist it in the store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from kvflow_ray.core.graph import Transitions, WorkflowSpec, WorkflowState
from kvflow_ray.core.registry import PolicyContext, Registry

# the narrow context of a choice: (chooser, agent before it, its pass number in the instance, capped)
Context = tuple[str, str, int]
MAX_PASS = 3
# the least probability of running next at which an agent's prompt is prefetched
PREFETCH_THRESHOLD = 0.6


def likely_reach(horizon: float, threshold: float = PREFETCH_THRESHOLD) -> float:
    """The expected steps within which an agent is prefetched: at most `horizon` steps away, the last
    of them a choice taken with probability >= `threshold` (a choice of probability p costs 1/p).
    With `threshold` > 0.5 the reach stays below horizon + 1, so on a workflow without choices the
    same agents are prefetched as by steps-to-execution <= horizon."""
    return horizon - 1 + 1 / threshold


@dataclass
class Accuracy:
    """How often the most likely next agent was the one that ran: one step ahead and two."""

    hits_1: int = 0
    total_1: int = 0
    hits_2: int = 0
    total_2: int = 0

    def ratio(self, steps: int) -> float | None:
        hits, total = (self.hits_1, self.total_1) if steps == 1 else (self.hits_2, self.total_2)
        return hits / total if total else None


class TransitionModel:
    """Learned choices of the `next: one` agents of one template (see the module docstring)."""

    def __init__(self, prior_strength: float = 2.0, decay: float = 0.95, max_contexts: int = 1024) -> None:
        if prior_strength <= 0 or not 0 < decay <= 1 or max_contexts < 1:
            raise ValueError("TransitionModel needs prior_strength > 0, 0 < decay <= 1 and max_contexts >= 1")
        self.prior_strength = prior_strength
        self.decay = decay
        self.max_contexts = max_contexts
        # context key ("u" or "u|prev|pass") -> successor -> decayed count
        self.counts: OrderedDict[str, dict[str, float]] = OrderedDict()
        self.accuracy = Accuracy()

    @staticmethod
    def context(chooser: str, history: Sequence[str]) -> Context:
        """The narrow context of `chooser`'s choice, from the agents started in this instance so far
        (oldest first, ending with the chooser's own start)."""
        before = history[-2] if len(history) >= 2 else ""
        return chooser, before, min(sum(1 for a in history if a == chooser), MAX_PASS)

    def observe(self, chooser: str, chosen: str, history: Sequence[str]) -> None:
        """`chooser` (a `next: one` agent) handed over to `chosen`."""
        for key in (chooser, "|".join(map(str, self.context(chooser, history)))):
            row = self.counts.pop(key, None) or {}
            for successor in row:
                row[successor] *= self.decay
            row[chosen] = row.get(chosen, 0.0) + 1.0
            self.counts[key] = row
        while len(self.counts) > self.max_contexts:
            self.counts.popitem(last=False)

    def choice(self, spec: WorkflowSpec, chooser: str, history: Sequence[str] | None = None) -> dict[str, float]:
        """The probability of each successor of `chooser`: the spec's weights, updated by what was
        seen for the chooser, updated by what was seen in the narrow context (when `history` gives it)."""
        estimate = spec.priors(chooser)
        keys = [chooser]
        if history is not None:
            keys.append("|".join(map(str, self.context(chooser, history))))
        for key in keys:
            row = self.counts.get(key)
            if not row:
                continue
            seen = sum(row.values())
            strength = self.prior_strength
            estimate = {v: (row.get(v, 0.0) + strength * p) / (seen + strength) for v, p in estimate.items()}
        return estimate

    def transitions(self, spec: WorkflowSpec, history: Sequence[str] = ()) -> dict[str, dict[str, float]]:
        """Every `next: one` agent's choice; the one that ran last gets its narrow context."""
        current = history[-1] if history else None
        return {u: self.choice(spec, u, history if u == current else None) for u in spec.choosers}

    def score(self, spec: WorkflowSpec, history: Sequence[str], started: str) -> None:
        """Count whether `started` was the most likely agent one step after `history[-1]` and two
        steps after `history[-2]` (only where the graph leaves a choice or a single successor)."""
        for steps in (1, 2):
            if len(history) < steps:
                continue
            guess = self.most_likely(spec, list(history[: len(history) - steps + 1]), steps)
            if guess is None:
                continue
            if steps == 1:
                self.accuracy.total_1 += 1
                self.accuracy.hits_1 += guess == started
            else:
                self.accuracy.total_2 += 1
                self.accuracy.hits_2 += guess == started

    def most_likely(self, spec: WorkflowSpec, history: list[str], steps: int) -> str | None:
        """The most likely agent `steps` starts after the last of `history` (None: no single successor)."""
        agent: str | None = history[-1]
        for _ in range(steps):
            if agent is None:
                return None
            successors = spec.successors(agent)
            if len(successors) == 1:
                agent = successors[0]
            elif agent in spec.choosers:
                odds = self.choice(spec, agent, history)
                agent = max(odds, key=lambda v: odds[v])
            else:
                return None
            history = [*history, agent]
        return agent

    def to_dict(self) -> dict[str, Any]:
        return {"counts": {k: dict(v) for k, v in self.counts.items()},
                "accuracy": [self.accuracy.hits_1, self.accuracy.total_1, self.accuracy.hits_2, self.accuracy.total_2]}

    def load(self, data: Mapping[str, Any]) -> TransitionModel:
        """Take the counts of a `to_dict` (from the store: malformed entries are skipped)."""
        counts = data.get("counts")
        if isinstance(counts, Mapping):
            for key, row in list(counts.items())[-self.max_contexts:]:
                if isinstance(key, str) and isinstance(row, Mapping):
                    clean = {str(v): float(c) for v, c in row.items()
                             if isinstance(c, int | float) and not isinstance(c, bool) and c >= 0}
                    self.counts[key] = clean
        acc = data.get("accuracy")
        if isinstance(acc, list) and len(acc) == 4 and all(isinstance(x, int) and x >= 0 for x in acc):
            self.accuracy = Accuracy(*acc)
        return self


class ChoiceModel(Protocol):
    """What a predictor reads choices from: a `TransitionModel`, or the truth a simulator knows."""

    def transitions(self, spec: WorkflowSpec, history: Sequence[str] = ()) -> dict[str, dict[str, float]]: ...


class Predictor(Protocol):
    """Turns a live instance into the steps its agents are ranked by."""

    name: str
    learns: bool  # it reads a `TransitionModel` that the driver updates on every agent start
    # its steps weigh choices by probability: prefetch reaches `likely_reach(horizon)` in them
    weighted: bool
    reads_truth: bool  # it ranks by the true next choices, which only a simulator knows (a bound)

    def steps(self, state: WorkflowState, model: ChoiceModel | None, history: Sequence[str]) -> dict[str, float]:
        ...


class GraphSteps:
    name = "graph"
    learns = False
    weighted = False
    reads_truth = False

    def steps(self, state: WorkflowState, model: ChoiceModel | None, history: Sequence[str]) -> dict[str, float]:
        return state.steps_to_execution()


class PriorSteps:
    """Expected steps under the choice model the forecast hands it; without one, the spec's weights."""

    name = "priors"
    learns = False
    weighted = True
    reads_truth = False

    def steps(self, state: WorkflowState, model: ChoiceModel | None, history: Sequence[str]) -> dict[str, float]:
        transitions: Transitions | None = None if model is None else model.transitions(state.spec, history)
        return state.expected_steps(transitions)


class LearnedSteps(PriorSteps):
    """The same, under the transition model the forecast learns from the agents it sees start."""

    name = "learned"
    learns = True


PREDICTION: Registry[Predictor] = Registry("prediction")
PREDICTION.register("graph", lambda context: GraphSteps())


@partial(PREDICTION.register, "priors")
def _priors(context: PolicyContext) -> Predictor:
    """expected steps under the spec's weights"""
    return PriorSteps()


@partial(PREDICTION.register, "learned")
def _learned(context: PolicyContext) -> Predictor:
    """expected steps under the transition model learned online (the spec's weights until it has seen calls)"""
    return LearnedSteps()


class TransitionBook:
    """The models of every (tenant, template), and each live instance's recent history: what the
    router (or a simulator standing in for it) updates on every call it sees. Bounded: at most
    `max_models` models and `history` agents per instance."""

    def __init__(self, max_models: int = 4096, history: int = 4, **model_options: Any) -> None:
        self.models: OrderedDict[tuple[str, str], TransitionModel] = OrderedDict()
        self.max_models = max_models
        self.history_len = history
        self.model_options = model_options

    def model(self, tenant: str, template: str) -> TransitionModel:
        key = (tenant, template)
        model = self.models.pop(key, None) or TransitionModel(**self.model_options)
        self.models[key] = model
        while len(self.models) > self.max_models:
            self.models.popitem(last=False)
        return model

    def started(self, tenant: str, template: str, state: WorkflowState, history: list[str], agent: str) -> list[str]:
        """`agent` starts in the instance whose started agents so far are `history` (called before
        `state.start(agent)`): learns the choice that led to it, scores the last predictions, and
        returns the new history."""
        spec = state.spec
        model = self.model(tenant, template)
        if history:
            model.score(spec, history, agent)
        got = state.arrived.get(agent, ())
        for chooser in spec.choosers_before(agent):
            if chooser in got:
                model.observe(chooser, agent, history)
        return [*history, agent][-self.history_len:]


class OracleSteps(PriorSteps):
    """expected steps under the true next choices (a simulator's recorded ones): the bound"""

    name = "oracle"
    reads_truth = True


PREDICTION.register("oracle", lambda context: OracleSteps())


class Forecaster:
    """What a workflow driver (the router, or a simulator or benchmark standing in for it) calls on
    every agent start and for every hint: the registered predictor plus the transition models it
    learns from (`learned`); `oracle` reads the truth its caller passes instead."""

    def __init__(self, prediction: str = "graph", book: TransitionBook | None = None) -> None:
        self.predictor: Predictor = PREDICTION.create(prediction)
        self.book = book if book is not None else TransitionBook()
        self.learns = self.predictor.learns

    def started(self, tenant: str, template: str, state: WorkflowState, history: list[str], agent: str) -> list[str]:
        """Before `state.start(agent)`: when learning a dynamic workflow, the model updated and the new
        history; otherwise `history` as it is (only a learned model reads it)."""
        if self.learns and state.spec.dynamic:
            return self.book.started(tenant, template, state, history, agent)
        return history

    def steps(self, tenant: str, template: str, state: WorkflowState, history: Sequence[str],
              truth: ChoiceModel | None = None) -> dict[str, float]:
        """The steps `state`'s agents are ranked by. `truth`: the true next choices, read only by a
        predictor that is a bound (`oracle`); every other one ignores it."""
        model: ChoiceModel | None = None
        if self.predictor.reads_truth:
            model = truth
        elif self.learns and state.spec.dynamic:
            model = self.book.model(tenant, template)
        return self.predictor.steps(state, model, history)
