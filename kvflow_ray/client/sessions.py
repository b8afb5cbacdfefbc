"""Drive agent sessions with tool pauses against a kvflow-ray server (`kvflow-ray run SESSION.yaml`).

A session spec names an agent (system prompt, task, tools with their durations and results) and how
many turns it takes. Each client runs one session through the OpenAI API: every turn but the last
forces a call of a tool drawn from the spec (`tool_choice` naming it), the client "runs" the tool by
waiting a duration drawn from the tool's two modes, and sends the whole history back with the
tool's result; the last turn answers in text with `kvflow.final_turn`. The session id goes in the
`X-Session-ID` header, so the server keeps the history's KV across each pause
(docs/serving.md#agent-sessions-docsdesignmd-11); `kvflow.agent`, the spec's name, is what the server
learns its tool pauses under.

```yaml
session: coder                 # names the sessions (a session spec: no `agents`)
system: You are a coding agent ...
task: The test suite fails ...
turns: 4                       # per session, the last one answers in text
max_tokens: 128                # per turn (a forced call needs room for its arguments)
tools:
  - name: run_tests
    description: Run the test suite
    parameters: {type: object, properties: {path: {type: string}}, required: [path]}
    duration_s: [0.5, 4.0]     # the tool's fast and slow mode (medians, seconds)
    slow_share: 0.3            # how often the slow mode happens (default 0.2)
    result: "1 failed, 41 passed: test_parse_numbers"
```
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvflow_ray.client.loadgen import counter_delta, run_concurrently, scrape, settled_metrics, summary_stats
from kvflow_ray.core.safe_yaml import describe_yaml_error, load_yaml, read_text_file

SIGMA = 0.6  # each mode of a tool's duration is lognormal around its median


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = Field("", max_length=1024)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    duration_s: tuple[float, float] = Field((0.2, 2.0))
    slow_share: float = Field(0.2, ge=0, le=1)
    result: str = Field("ok", max_length=20_000)

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def draw(self, rng: random.Random) -> float:
        fast, slow = self.duration_s
        median = slow if rng.random() < self.slow_share else fast
        return max(0.0, median * math.exp(rng.gauss(0.0, SIGMA)))


class SessionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    system: str = Field(max_length=100_000)
    task: str = Field(max_length=20_000)
    turns: int = Field(4, ge=1, le=64)
    max_tokens: int = Field(128, ge=1, le=4096)
    tools: list[ToolSpec] = Field(min_length=1, max_length=32)


def is_session_spec(path: Path) -> bool:
    """Whether the YAML file at `path` is a session spec (a top-level `session` key)."""
    try:
        data = load_yaml(read_text_file(path))
    except Exception:
        return False
    return isinstance(data, dict) and "session" in data


def load_session_spec(path: Path) -> SessionSpec:
    """The spec at `path`; ValueError naming what is wrong."""
    try:
        data = load_yaml(read_text_file(path))
    except Exception as exc:
        message = describe_yaml_error(exc) if hasattr(exc, "problem_mark") else str(exc)
        raise ValueError(f"{path}: {message}") from None
    try:
        return SessionSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{path}: {where}: {first['msg']}") from None


@dataclass
class TurnRecord:
    session: int
    turn: int
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str
    tool: str = ""
    error: str | None = None


@dataclass
class SessionResult:
    turns: list[TurnRecord] = field(default_factory=list)
    jobs: list[float] = field(default_factory=list)  # each session's completion time (pauses included)
    pauses: list[float] = field(default_factory=list)  # the tool durations the clients waited
    wall_s: float = 0.0
    metrics_before: dict[Any, float] = field(default_factory=dict)
    metrics_after: dict[Any, float] = field(default_factory=dict)
    answers: list[str] = field(default_factory=list)


class _Session:
    def __init__(self, index: int, spec: SessionSpec, base_url: str, api_key: str | None, model: str | None,
                 result: SessionResult, lock: threading.Lock, on_turn: Callable[[], None]) -> None:
        import openai

        self.index, self.spec, self.result, self.lock, self.on_turn = index, spec, result, lock, on_turn
        self.model = model or "default"
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "unused", max_retries=0, timeout=600)
        self.id = f"{spec.session}-{index}-{uuid.uuid4().hex[:8]}"
        self.rng = random.Random(f"kvflow-session:{spec.session}:{index}")

    def go(self) -> None:
        spec = self.spec
        tools = [t.openai() for t in spec.tools]
        messages: list[Any] = [{"role": "system", "content": spec.system}, {"role": "user", "content": spec.task}]
        started = time.perf_counter()
        for turn in range(spec.turns):
            last = turn == spec.turns - 1
            tool = None if last else self.rng.choice(spec.tools)
            choice: Any = "none" if tool is None else {"type": "function", "function": {"name": tool.name}}
            t0 = time.perf_counter()
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model=self.model, messages=messages, tools=tools, tool_choice=choice, max_tokens=spec.max_tokens,
                    temperature=0, extra_headers={"X-Session-ID": self.id},
                    # the agent names what the server learns this session's tool pauses under
                    extra_body={"kvflow": {"agent": spec.session, **({"final_turn": True} if last else {})}})
                response = raw.parse()
            except Exception as exc:
                self._record(TurnRecord(self.index, turn, time.perf_counter() - t0, 0, 0, "?",
                                        error=f"{type(exc).__name__}: {exc}"))
                return
            usage = response.usage
            details = getattr(usage, "prompt_tokens_details", None)
            message = response.choices[0].message
            self._record(TurnRecord(self.index, turn, time.perf_counter() - t0, usage.prompt_tokens if usage else 0,
                                    (details.cached_tokens or 0) if details else 0,
                                    raw.headers.get("x-kvflow-replica", "?"), tool.name if tool else ""))
            if tool is None:
                with self.lock:
                    self.result.answers.append(message.content or "")
                break
            calls = message.tool_calls or []
            messages.append(message)
            # the client runs the tool: it takes its drawn time, then its result joins the history
            pause = tool.draw(self.rng)
            with self.lock:
                self.result.pauses.append(pause)
            time.sleep(pause)
            for call in calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": tool.result})
        with self.lock:
            self.result.jobs.append(time.perf_counter() - started)

    def _record(self, record: TurnRecord) -> None:
        with self.lock:
            self.result.turns.append(record)
        self.on_turn()


def run_sessions(spec: SessionSpec, base_url: str, clients: int, *, api_key: str | None = None,
                 metrics_token: str | None = None, model: str | None = None, progress: bool = True) -> SessionResult:
    """`clients` concurrent sessions of `spec` against the server at `base_url` (its root)."""
    from kvflow_ray.progress import progress as progress_bar

    root = base_url.rstrip("/").removesuffix("/v1")
    result = SessionResult(metrics_before=scrape(root, metrics_token))
    lock = threading.Lock()
    bar = progress_bar(clients * spec.turns, f"run {spec.session}", "turn", disable=not progress)
    sessions = [_Session(i, spec, root + "/v1", api_key, model, result, lock, lambda: bar.update(1))
                for i in range(clients)]
    started = time.perf_counter()
    run_concurrently([(f"session-{s.index}", s.go) for s in sessions])
    bar.close()
    result.wall_s = time.perf_counter() - started
    answered = sum(t.prompt_tokens for t in result.turns if t.error is None)
    result.metrics_after = settled_metrics(root, metrics_token, result.metrics_before, answered)
    return result


def summarise_sessions(result: SessionResult, spec: SessionSpec, clients: int) -> dict[str, Any]:
    """The `kvflow-ray run SESSION.yaml --json` object."""
    ok = [t for t in result.turns if t.error is None]
    errors = [t for t in result.turns if t.error is not None]
    delta = lambda name, **labels: counter_delta(result.metrics_before, result.metrics_after, name, **labels)  # noqa: E731
    prompt = {tier: delta("kvflow_prompt_tokens_total", tier=tier) for tier in ("gpu", "cpu", "miss")}
    total = sum(prompt.values())
    pauses = delta("kvflow_session_pauses_total")
    return {
        "session": spec.session, "sessions": clients, "turns": len(result.turns), "errors": len(errors),
        "first_error": errors[0].error if errors else None, "wall_s": round(result.wall_s, 3),
        "job_completion_s": summary_stats(result.jobs), "turn_latency_s": summary_stats([t.latency_s for t in ok]),
        "tool_pause_s": summary_stats(result.pauses),
        "cached_ratio": _ratio(sum(t.cached_tokens for t in ok), sum(t.prompt_tokens for t in ok)),
        "gpu_hit_ratio": _ratio(prompt["gpu"], total), "cpu_hit_ratio": _ratio(prompt["cpu"], total),
        "recomputed_tokens": int(prompt["miss"]),
        "replicas_per_session": max((len({t.replica for t in ok if t.session == s}) for s in range(clients)),
                                    default=0),
        "pauses": {"ended": int(pauses),
                   "mean_abs_error_s": _ratio(delta("kvflow_session_pause_error_seconds_total"), pauses),
                   "prefetch_early": int(delta("kvflow_session_prefetch_total", timing="early")),
                   "prefetch_late": int(delta("kvflow_session_prefetch_total", timing="late"))},
        "answer": result.answers[0] if result.answers else "",
    }


def format_sessions(s: dict[str, Any]) -> str:
    secs = lambda v: "n/a" if v is None else f"{v:.2f} s"  # noqa: E731
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    job, turn, pause = s["job_completion_s"], s["turn_latency_s"], s["tool_pause_s"]
    p = s["pauses"]
    lines = [
        f"session {s['session']}: {s['sessions']} sessions, {s['turns']} turns ({s['errors']} failed) "
        f"in {s['wall_s']:.1f} s",
        f"  job completion  mean {secs(job['mean'])}   p50 {secs(job['p50'])}   p99 {secs(job['p99'])}",
        f"  turn latency    mean {secs(turn['mean'])}   p50 {secs(turn['p50'])}   p99 {secs(turn['p99'])}",
        f"  tool pauses     mean {secs(pause['mean'])}   p99 {secs(pause['p99'])}   predicted with mean error "
        f"{secs(p['mean_abs_error_s'])} over {p['ended']} pauses; prefetch due early {p['prefetch_early']}, "
        f"late {p['prefetch_late']}",
        f"  prompt tokens cached (usage) {pct(s['cached_ratio'])}, from device {pct(s['gpu_hit_ratio'])}, from host "
        f"{pct(s['cpu_hit_ratio'])}; recomputed {s['recomputed_tokens']:,}; replicas per session at most "
        f"{s['replicas_per_session']}",
    ]
    if s["first_error"]:
        lines.append(f"  first error: {s['first_error']}")
    if s["answer"]:
        flat = " ".join(s["answer"].split())
        lines.append(f"  a final answer: {flat[:160] + ' ...' if len(flat) > 160 else flat}")
    return "\n".join(lines)


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None



__all__ = ["SessionSpec", "ToolSpec", "format_sessions", "is_session_spec", "load_session_spec", "run_sessions",
           "summarise_sessions"]
