"""Peers' policies for agent sessions in tool pauses, rebuilt from their sources with their rules, as
baselines for `kvflow` (which ranks a paused history by its predicted return, `core.sessions`).
They read the replica's `SessionBook` (what each session is doing) and the clock; their keys move
with time, so the cache ranks every candidate per decision (not `incremental`).

- `tlru`: SGLang's agentic T-LRU (sgl-project/sglang PR #34012, `python/sglang/srt/mem_cache/
  evict_policy.py`, `TLRUStrategy`; arXiv 2510.15152). A node is "TEL-safe" when the tokens above
  it already cover the conversation's budget `L + Q̂ - ξ` (L: the longest history reached below it,
  Q̂ `next_prompt_estimate`: the next turn's new tokens, ξ `threshold`: the uncached tokens the next
  prefill may recompute). TEL-safe tails go first, oldest first, then plain LRU. SGLang's defaults
  (0, 0) make it LRU; the agentic benchmark sets both (`benchmarks/agentic.py`).
- `retention`: SGLang's `retention_seconds` under `--radix-eviction-policy priority` (PR #27970,
  `PriorityStrategy`): key (priority, last access), where a node's priority decays to 0 once
  `retention_s` passed since its last access; a session's turns carry priority 1.
- `continuum`: Continuum's TTL pinning (arXiv 2511.02230; its vLLM fork, `vllm/v1/core/sched/
  scheduler.py`, `estimate_with_func.py`, `request_queue.py`, `FIXED_THRESHOLD_CONTINUUM = 2.0`): when
  a turn ends with a tool call whose mean observed duration is at most 2 s (or none observed yet),
  its KV is pinned for 2 s, and stays pinned past that while the job's next request waits. Memory
  short: unpinned KV goes first (LRU), then the pin ending latest. Its queue (`continuum` admission):
  requests of pinned jobs first, then job-level FCFS (the job's first arrival).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

from kvflow_ray.core.admission import ADMISSION, ArrivalAdmission
from kvflow_ray.core.policies import EVICTION, EvictionPolicy
from kvflow_ray.core.radix import RadixNode
from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.core.sessions import SessionBook, SessionState

R = TypeVar("R")
CONTINUUM_PIN_S = 2.0  # FIXED_THRESHOLD_CONTINUUM


def _sessions_of(node: RadixNode, sessions: SessionBook) -> Iterable[SessionState]:
    for workflow, _agent in node.tags:
        state = sessions.state(workflow)
        if state is not None:
            yield state


def _needs(context: PolicyContext, name: str) -> tuple[SessionBook, Any]:
    if context.sessions is None or context.clock is None:
        raise ValueError(f"the {name} eviction policy needs the replica's session book and clock")
    return context.sessions, context.clock


class TLRUPolicy:
    name = "tlru"

    def __init__(self, sessions: SessionBook, threshold: int = 0, next_prompt_estimate: int = 0) -> None:
        self.sessions = sessions
        self.threshold = threshold
        self.next_prompt_estimate = next_prompt_estimate

    def priority(self, node: RadixNode) -> tuple[float, ...]:
        start = node.end() - len(node.key)  # tokens above the node
        history = max((s.tokens for s in _sessions_of(node, self.sessions)), default=start + len(node.key))
        budget = max(history + self.next_prompt_estimate - self.threshold, 0)
        return (-1 if start >= budget else 0, node.last_access)


class RetentionPolicy:
    name = "retention"

    def __init__(self, sessions: SessionBook, clock: Any, retention_s: float = 30.0) -> None:
        self.sessions, self.clock, self.retention_s = sessions, clock, retention_s

    def priority(self, node: RadixNode) -> tuple[float, ...]:
        now = self.clock()
        retained = any(s.paused_at is None or now - s.paused_at < self.retention_s
                       for s in _sessions_of(node, self.sessions))
        return (1 if retained else 0, node.last_access)

    def pins(self, state: SessionState) -> bool:
        """A paused history held (ranked last) until its retention passes."""
        return state.paused_at is not None and self.clock() - state.paused_at < self.retention_s


def continuum_pinned(state: SessionState, now: float) -> float | None:
    """When session `state`'s pin ends (None: not pinned). Its latest turn called a known tool whose
    mean pause so far is at most 2 s (none observed counts as 0): pinned for 2 s from the pause, and
    past that while its next request is in (the fork frees a pin only once the job has none waiting)."""
    if state.last_paused_at is None or not state.turn.tool or (state.tool_mean or 0.0) > CONTINUUM_PIN_S:
        return None
    end = state.last_paused_at + CONTINUUM_PIN_S
    return end if state.paused_at is None or now < end else None


class ContinuumPolicy:
    name = "continuum"

    def __init__(self, sessions: SessionBook, clock: Any) -> None:
        self.sessions, self.clock = sessions, clock

    def priority(self, node: RadixNode) -> tuple[float, ...]:
        now = self.clock()
        ends = [end for s in _sessions_of(node, self.sessions) if (end := continuum_pinned(s, now)) is not None]
        return (1, -max(ends)) if ends else (0, node.last_access)

    def pins(self, state: SessionState) -> bool:
        return state.paused_at is not None and continuum_pinned(state, self.clock()) is not None


class ContinuumAdmission(ArrivalAdmission):
    """Continuum's queue: pinned jobs first, then each job by its first arrival (vLLM's waiting queue
    in its fork). Loads and batches as vLLM's: a batch waits for its loads (no status awareness)."""

    name = "continuum"

    def __init__(self, sessions: SessionBook, clock: Any) -> None:
        self.sessions, self.clock = sessions, clock

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> Iterable[R]:
        now = self.clock()

        def key(req: Any) -> tuple[int, float, int]:
            state = self.sessions.state(req.workflow) if req.workflow is not None else None
            if state is None:
                return (1, req.arrival, req.seq)
            return (0 if continuum_pinned(state, now) is not None else 1, state.opened, req.seq)

        return sorted(waiting, key=key)


@partial(EVICTION.register, "tlru")
def _tlru(context: PolicyContext, *, threshold: int = 0, next_prompt_estimate: int = 0) -> EvictionPolicy:
    """SGLang's T-LRU: conversation tails beyond L + Q̂ - ξ tokens first, then LRU"""
    sessions, _clock = _needs(context, "tlru")
    return TLRUPolicy(sessions, threshold, next_prompt_estimate)


@partial(EVICTION.register, "retention")
def _retention(context: PolicyContext, *, retention_s: float = 30.0) -> EvictionPolicy:
    """SGLang's priority policy with retention_seconds: retained sessions last, each level LRU"""
    return RetentionPolicy(*_needs(context, "retention"), retention_s)


@partial(EVICTION.register, "continuum")
def _continuum(context: PolicyContext) -> EvictionPolicy:
    """Continuum: unpinned KV first (LRU), then the pin ending latest"""
    return ContinuumPolicy(*_needs(context, "continuum"))


@partial(ADMISSION.register, "continuum")
def _continuum_admission(context: PolicyContext) -> ContinuumAdmission:
    """Continuum: pinned jobs first, then job-level FCFS"""
    return ContinuumAdmission(*_needs(context, "continuum"))
