"""Agent sessions: a client's conversation that grows turn by turn across tool pauses (docs/design.md §11).

A session is a workflow instance with one agent, `SESSION_AGENT`: its fixed prompt is the history so
far (every earlier turn's prompt and output), registered and tagged when a turn ends, so the radix
tree, the eviction index and prefetch treat it as they treat an agent's prompt.

What a session adds is *time*. Between turns the client runs a tool for a fraction of a second or for
minutes. Eviction and prefetch rank KV by the expected time until its next use; for a session in a
pause that is the predicted tool duration (`PauseModel`, by registry), learned online per (tenant,
agent, tool) from the gaps observed between a turn's end and the next turn. `SessionBook` turns the
prediction into a distance in the `StepBook` (one ranking with the workflow agents' steps):

- a running turn is at distance 0;
- a paused session is at `near_horizon + 1 + (expected return - origin) / seconds_per_step`: ranked by
  when it returns, never near enough to prefetch;
- from `due_at` = the early edge of the prediction less the copy time back (erring early) it is near
  (distance in [0, 1), the sooner its return the nearer), so prefetch loads its history back;
- a pause that outlives its prediction is re-predicted from the gaps longer than it has lasted.

The origin moves to the present every `rebase_s` seconds (re-ranking the paused sessions), so a
session's distance is comparable to an agent's steps to within `rebase_s / seconds_per_step`.
Retention is bounded per tenant: paused histories beyond `tenant_retain_tokens` rank as unneeded.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from kvflow_ray.core.registry import PolicyContext, Registry

SESSION_AGENT = "session"
INF = math.inf
MIN_RECHECK_S = 0.05  # a pause past its prediction is predicted again at least this much later
ToolKey = tuple[str, str, str]  # (tenant, agent or template, tool name; "" when unknown)


@dataclass(frozen=True)
class Forecast:
    """A pause's prediction, in seconds from its start: `expected` ranks eviction, `early` (<= expected)
    is the edge prefetch aims to beat."""

    expected: float
    early: float


@dataclass(frozen=True)
class SessionTurn:
    """What a session's request says about it (the `kvflow` metadata, or a simulated client).
    `true_pause_s`: the length of the pause after this turn, known only to a simulated client (the
    pause oracle's input)."""

    tenant: str = ""
    agent: str = "agent"
    tool: str = ""  # the tool this turn's output calls (its pause follows); "" when unknown
    hint_s: float | None = None  # the client's expected pause (`kvflow.expected_pause_s`, a cache TTL)
    final: bool = False  # the session ends with this turn: its KV is released at once
    true_pause_s: float | None = None
    tool_parser: str | None = None  # serving: the format its output calls tools in (the tool is read from it)
    tool_names: tuple[str, ...] | None = None  # serving: the request's tools (a call to another name is text)


class PauseModel(Protocol):
    name: str

    def forecast(self, key: ToolKey, hint: float | None, truth: float | None, elapsed: float = 0.0) -> Forecast:
        """The pause after a turn calling `key`'s tool, given it has lasted `elapsed` seconds already."""
        ...

    def observe(self, key: ToolKey, gap: float) -> None:
        """A pause of `key`'s tool ended after `gap` seconds."""
        ...

    def mean(self, key: ToolKey) -> float | None:
        """The mean observed pause of `key`'s tool (None before any)."""
        ...


class LearnedPauses:
    """Online per (tenant, agent, tool): the last `window` observed gaps. Expected = their median
    (of those longer than the time already elapsed), early = their `early_q` quantile. Without
    observations of the tool, the client's hint, else the agent's gaps over every tool, else
    `default_s`. Bounded per tenant: `max_keys` (agent, tool) keys each, its least recently used going
    first, so the agent and tool names one tenant sends never displace another tenant's."""

    name = "learned"

    def __init__(self, window: int = 32, default_s: float = 5.0, early_q: float = 0.2, max_keys: int = 4_096) -> None:
        if window < 1 or default_s <= 0 or not 0 <= early_q <= 0.5:
            raise ValueError("learned pauses need window >= 1, default_s > 0 and 0 <= early_q <= 0.5")
        self.window, self.default_s, self.early_q, self.max_keys = window, default_s, early_q, max_keys
        self._gaps: dict[str, OrderedDict[tuple[str, str], deque[float]]] = {}  # tenant -> (agent, tool) -> gaps

    def _gaps_of(self, key: ToolKey) -> deque[float] | None:
        tenant = self._gaps.get(key[0])
        return tenant.get(key[1:]) if tenant is not None else None

    def _seen(self, key: ToolKey) -> deque[float] | None:
        """`key`'s gaps, its tenant's most recently used key now."""
        gaps = self._gaps_of(key)
        if gaps is not None:
            self._gaps[key[0]].move_to_end(key[1:])
        return gaps

    def observe(self, key: ToolKey, gap: float) -> None:
        tenant = self._gaps.setdefault(key[0], OrderedDict())
        for k in (key[1:], (key[1], "*")):
            gaps = tenant.get(k)
            if gaps is None:
                gaps = tenant[k] = deque(maxlen=self.window)
                if len(tenant) > self.max_keys:
                    tenant.popitem(last=False)
            else:
                tenant.move_to_end(k)
            gaps.append(max(0.0, gap))

    def keys(self, tenant: str) -> int:
        """How many (agent, tool) keys `tenant` has gaps for (at most `max_keys`)."""
        return len(self._gaps.get(tenant, ()))

    def mean(self, key: ToolKey) -> float | None:
        gaps = self._gaps_of(key)
        return statistics.fmean(gaps) if gaps else None

    def forecast(self, key: ToolKey, hint: float | None, truth: float | None, elapsed: float = 0.0) -> Forecast:
        gaps = self._seen(key)
        if not gaps and hint is None:
            gaps = self._seen((key[0], key[1], "*"))
        if not gaps:
            base = hint if hint is not None else self.default_s
            if base > elapsed:
                return Forecast(base, base * self.early_q / 0.5 if self.early_q else 0.0)
            return Forecast(2 * elapsed, elapsed)  # outlived the guess: a survivor lasts about as long again
        longer = sorted(g for g in gaps if g > elapsed)
        if not longer:
            return Forecast(2 * elapsed, elapsed)
        expected = longer[len(longer) // 2]
        early = max(elapsed, longer[int(self.early_q * (len(longer) - 1))])
        return Forecast(expected, min(early, expected))


class OraclePauses(LearnedPauses):
    """Knows each pause's true length (a simulated client's draw): the bound a predictor aims at. A
    pause no one can know ahead (a planner waiting for its sub-agents) is learned as `LearnedPauses`."""

    name = "oracle"

    def forecast(self, key: ToolKey, hint: float | None, truth: float | None, elapsed: float = 0.0) -> Forecast:
        if truth is None:
            return super().forecast(key, hint, truth, elapsed)
        return Forecast(truth, truth)


PAUSES: Registry[PauseModel] = Registry("pause prediction")


@partial(PAUSES.register, "learned")
def _learned(context: PolicyContext, *, window: int = 32, default_s: float = 5.0, early_q: float = 0.2) -> PauseModel:
    """median of the tool's last `window` pauses, prefetch by their `early_q` quantile"""
    return LearnedPauses(window, default_s, early_q)


PAUSES.register("oracle", lambda context: OraclePauses())  # each pause's true length (simulation only)


@dataclass(eq=False)
class SessionState:
    key: str
    turn: SessionTurn
    opened: float  # the session's first turn arrived (job-level FCFS orders by it)
    # its first turn's prompt, in tokens: what it shares with its application's sessions (the system
    # prompt and tools) lies within it, and stays cached when the session ends
    first_prompt: int = 0
    tokens: int = 0  # history tokens (prompt and output of its turns so far)
    paused_at: float | None = None
    forecast: Forecast | None = None
    predicted: float = 0.0  # the pause expected when it began (what its prediction error is scored on)
    returns_at: float = INF  # paused_at + forecast.expected
    due_at: float = INF  # from then on its history is prefetched
    retained: int = 0  # tokens it counts against its tenant's retention bound while paused
    # the latest pause's start and its tool's mean observed pause then (kept while the next turn runs)
    last_paused_at: float | None = None
    tool_mean: float | None = None
    generation: int = 0  # invalidates its queued wake-ups


@dataclass
class PauseStats:
    """Pause predictions against outcomes, and prefetch timing at each return."""

    pauses: int = 0
    abs_error_s: float = 0.0  # sum over ended pauses of |expected - actual|
    signed_error_s: float = 0.0  # sum of expected - actual (> 0: predicted too long)
    due_before_return: int = 0  # prefetch became due before the client came back
    due_after_return: int = 0  # the client came back before its history was due (late)
    # where the history was when the client came back: all on the device (kept, or its prefetch had
    # landed), part of it still loading (the prefetch arrived late), or part of it on the host or gone
    # (loaded on demand or computed again)
    returned: dict[str, int] = field(default_factory=lambda: {"ready": 0, "loading": 0, "missed": 0})
    errors: list[float] = field(default_factory=list)  # |expected - actual| per pause, the latest 10,000



class SessionBook:
    """Every live session on one replica and its pause, published into `steps` (a `policies.StepBook`)
    as a distance (module docstring). `load_seconds(tokens)`: the time to copy a history back from the
    host tier, which sets how early prefetch starts. The engine calls `advance(now)` at `next_wake()`."""

    def __init__(self, steps: object, pauses: PauseModel, *, load_seconds: Callable[[int], float] = lambda n: 0.0,
                 seconds_per_step: float = 1.0, rebase_s: float = 10.0,
                 tenant_retain_tokens: int | None = None, lead_factor: float = 2.0,
                 lead_margin_s: float = 0.05) -> None:
        self.steps = steps
        self.pauses = pauses
        self.load_seconds = load_seconds
        self.seconds_per_step = seconds_per_step
        self.rebase_s = rebase_s
        self.tenant_retain_tokens = tenant_retain_tokens
        self.lead_factor, self.lead_margin_s = lead_factor, lead_margin_s
        self.sessions: dict[str, SessionState] = {}
        self.paused: dict[str, SessionState] = {}
        self.retained: dict[str, int] = {}  # tenant -> paused history tokens ranked as needed
        self._tenants: set[str] = set()  # tenants that ever retained (their gauge reads 0 when none now)
        self._pinning: set[str] = set()  # tenants that ever had a pinned history (the same, for pins)
        self.origin = 0.0
        self._wakes: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self.stats = PauseStats()

    # ------------------------------------------------------------------ turns
    def resumed(self, key: str, turn: SessionTurn, now: float, prompt_tokens: int = 0) -> int | None:
        """A turn of session `key` arrived with a prompt of `prompt_tokens`: a pause ended (learned
        from), its history is in use. Returns the history's tokens when a pause ended (the caller
        says where they were: `returned`), else None."""
        state = self.sessions.get(key)
        history = None
        if state is None:
            state = self.sessions[key] = SessionState(key, turn, opened=now, first_prompt=prompt_tokens)
        elif state.paused_at is not None:
            gap = now - state.paused_at
            self.pauses.observe(self._tool_key(state), gap)
            self._score(state, gap, now)
            self._unpause(state)
            history = state.tokens
        state.turn = turn
        state.generation += 1
        self._publish(state, 0.0)
        return history

    def returned(self, on_device: bool, loading: bool) -> None:
        """Where the history of a session whose client just came back was: all `on_device`, else part
        of it still `loading` (a prefetch in flight), else part of it on the host or gone."""
        self.stats.returned["ready" if on_device else "loading" if loading else "missed"] += 1

    def pause(self, key: str, turn: SessionTurn, tokens: int, now: float) -> Forecast:
        """Session `key`'s turn ended with `tokens` of history and a tool call: predict the pause,
        rank the history by it and wake up when its prefetch is due. Returns the forecast (the
        caller writes the history back to the host at once when the pause outlasts the copy back)."""
        state = self.sessions.get(key)
        if state is None:
            state = self.sessions[key] = SessionState(key, turn, opened=now)
        state.turn, state.tokens = turn, tokens
        state.paused_at = state.last_paused_at = now
        state.tool_mean = self.pauses.mean(self._tool_key(state)) if turn.tool else None
        self.paused[key] = state
        self._forecast(state, now)
        assert state.forecast is not None
        state.predicted = state.forecast.expected
        cap = self.tenant_retain_tokens
        tenant = turn.tenant
        if cap is None or self.retained.get(tenant, 0) + tokens <= cap:
            state.retained = tokens
            self.retained[tenant] = self.retained.get(tenant, 0) + tokens
            self._tenants.add(tenant)
        self._rank(state, now)
        assert state.forecast is not None
        return state.forecast

    def close(self, key: str) -> int | None:
        """The session ended (its final turn, or the client said so): forget it. Returns its first
        prompt's length (None: no such session)."""
        state = self.sessions.pop(key, None)
        if state is None:
            return None
        self._unpause(state)
        state.generation += 1
        return state.first_prompt

    # ------------------------------------------------------------------ time
    def next_wake(self) -> float | None:
        while self._wakes:
            at, _seq, key, generation = self._wakes[0]
            state = self.paused.get(key)
            if state is not None and state.generation == generation:
                return at
            heapq.heappop(self._wakes)
        return None

    def advance(self, now: float) -> None:
        """Apply what time changed: prefetches that fell due, pauses that outlived their prediction,
        and the origin's move."""
        if now - self.origin > self.rebase_s:
            self.origin = now
            for state in list(self.paused.values()):
                if now < state.due_at:
                    self._rank(state, now)
        while self._wakes and self._wakes[0][0] <= now:
            _at, _seq, key, generation = heapq.heappop(self._wakes)
            state = self.paused.get(key)
            if state is None or state.generation != generation:
                continue
            if now >= state.returns_at:  # outlived its prediction: predict the rest
                self._forecast(state, now)
            self._rank(state, now)

    # ------------------------------------------------------------------ reading
    def report(self, pins: Callable[[SessionState], bool] | None = None) -> dict[str, object]:
        """What metrics read (`EngineSnapshot.sessions`): cumulative pause counts and errors, and per
        tenant now the retained tokens (paused histories ranked as needed) and the pinned ones (paused
        histories the eviction policy holds whatever their rank, `pins`: Continuum's pins, SGLang's
        retention; kvflow pins nothing). O(paused sessions)."""
        s = self.stats
        pinned: dict[str, int] = dict.fromkeys(self._pinning, 0)
        if pins is not None:
            for state in self.paused.values():
                if pins(state):
                    tenant = state.turn.tenant
                    self._pinning.add(tenant)
                    pinned[tenant] = pinned.get(tenant, 0) + state.tokens
        return {"pauses": s.pauses, "abs_error_s": s.abs_error_s, "due_early": s.due_before_return,
                "due_late": s.due_after_return, "returned": dict(s.returned),
                "retained_tokens": {tenant: self.retained.get(tenant, 0) for tenant in self._tenants},
                "pinned_tokens": pinned}

    def state(self, key: str) -> SessionState | None:
        return self.sessions.get(key)

    def lead(self, tokens: int) -> float:
        """How long before its return a history's prefetch starts: its copy, with room to spare."""
        return self.lead_factor * self.load_seconds(tokens) + self.lead_margin_s

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _tool_key(state: SessionState) -> ToolKey:
        return (state.turn.tenant, state.turn.agent, state.turn.tool)

    def _forecast(self, state: SessionState, now: float) -> None:
        assert state.paused_at is not None
        elapsed = now - state.paused_at
        turn = state.turn
        truth = turn.true_pause_s
        forecast = self.pauses.forecast(self._tool_key(state), turn.hint_s, truth, elapsed)
        if state.paused_at + forecast.expected <= now:  # due, yet the client is not back: later than told
            forecast = Forecast(elapsed + max(MIN_RECHECK_S, elapsed), forecast.early)
        state.forecast = forecast
        state.returns_at = state.paused_at + forecast.expected
        state.due_at = state.paused_at + state.forecast.early - self.lead(state.tokens)

    def _rank(self, state: SessionState, now: float) -> None:
        state.generation += 1
        if not state.retained:
            self._publish(state, INF)
            return
        if now >= state.due_at:
            remaining = max(0.0, state.returns_at - now)
            lead = self.lead(state.tokens)
            self._publish(state, remaining / (remaining + lead))
            self._wake(state, state.returns_at)
        else:
            self._publish(state, self.steps.near_horizon + 1  # type: ignore[attr-defined]
                          + max(0.0, state.returns_at - self.origin) / self.seconds_per_step)
            self._wake(state, state.due_at)

    def _wake(self, state: SessionState, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._wakes, (at, self._seq, state.key, state.generation))

    def _publish(self, state: SessionState, distance: float) -> None:
        self.steps.set_steps(state.key, {SESSION_AGENT: distance})  # type: ignore[attr-defined]

    def _unpause(self, state: SessionState) -> None:
        self.paused.pop(state.key, None)
        if state.retained:
            tenant = state.turn.tenant
            self.retained[tenant] -= state.retained
            if not self.retained[tenant]:
                del self.retained[tenant]
            state.retained = 0
        state.paused_at, state.forecast = None, None
        state.returns_at = state.due_at = INF

    def _score(self, state: SessionState, gap: float, now: float) -> None:
        stats = self.stats
        error = state.predicted - gap
        stats.pauses += 1
        stats.abs_error_s += abs(error)
        stats.signed_error_s += error
        if len(stats.errors) < 10_000:
            stats.errors.append(abs(error))
        if state.due_at <= now:
            stats.due_before_return += 1
        else:
            stats.due_after_return += 1
