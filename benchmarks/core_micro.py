"""Micro-benchmarks of the engine-agnostic KV-cache brain (`kvflow_ray/core`).

1. Replay. The request token sequences (and the steps-to-execution hints and retirements the router
   published between them) of real simulator runs are recorded by wrapping `SimReplica.submit`,
   `Simulation.publish` and `Simulation.retire` for the duration of the recording only, written as
   JSON lines, read back and replayed against a fresh `TieredCache` (host tier on) whose device
   capacity forces eviction, once per eviction policy (`lru`, `kvflow`). Every request does
   match -> lock -> make_room -> alloc -> commit -> tag -> unlock, the benchmark playing the engine
   (write-backs and loads complete at once). Each operation class is timed separately.
2. Priority updates. 1,000 live workflows of a 10-agent sequential loop, each agent with a 256-token
   fixed prompt that starts with a 64-token preamble shared by every workflow (so the preamble node
   carries 10,000 tags). Times (a) one agent transition per workflow (finish + start +
   steps_to_execution + StepBook.set_steps), (b) the first eviction decision after an update
   (KVFlowPolicy distances are cached per StepBook version, so an update invalidates them), against a
   repeat decision with valid caches and an LRU decision on the same tree, plus the distance of the
   shared preamble node, and (c) retiring the workflows.

Run: python benchmarks/core_micro.py [--json] [--out FILE]. Progress goes to stderr; the summary table
(or, with --json, one JSON object) to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.graph import WorkflowState
from kvflow_ray.core.policies import KVFlowPolicy, LRUPolicy, StepBook, make_eviction_policy
from kvflow_ray.core.stats import percentile
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.replica import SimReplica, SimRequest
from kvflow_ray.engines.sim.runner import simulate
from kvflow_ray.engines.sim.simulator import Simulation

now_ns = time.perf_counter_ns

# operation classes of the replay, in table order
REPLAY_OPS = ("insert", "match", "evict", "evict_host_full", "make_room_noop", "offload_done", "load", "alloc", "lock",
              "unlock", "tag", "hint", "retire")
REPLAY_OP_DOC = {
    "insert": "TieredCache.commit (prompt + output); tokens = sequence length",
    "match": "TieredCache.match (lookup + touch, splits); tokens = prompt length",
    "evict": "make_room calls that evicted; tokens = device tokens dropped or written back in the call",
    "evict_host_full": "the evict calls that also had to free host-tier space (host tier full)",
    "make_room_noop": "make_room calls that found enough room (or evicted nothing)",
    "offload_done": "TieredCache.finish_offload (write-back landed: frees the device copy)",
    "load": "start_load + finish_load of host-only matched nodes; tokens = loaded",
    "alloc": "TieredCache.alloc of the request's private tokens",
    "lock": "RadixTree.lock of the matched path",
    "unlock": "RadixTree.unlock of the matched path",
    "tag": "RadixTree.tag_prefix of the agent's fixed prompt",
    "hint": "StepBook.set_steps (a published steps-to-execution update)",
    "retire": "StepBook.retire + TieredCache.retire_workflow",
}
HEADLINE_OPS = ("insert", "match", "evict")


# ---------------------------------------------------------------------------------------------- stats
class OpStats:
    """Per-operation latency samples (ns) and token counts."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.tokens = 0

    def add(self, ns: int, tokens: int = 0) -> None:
        self.samples.append(ns)
        self.tokens += tokens

    def extend(self, other: OpStats) -> None:
        self.samples.extend(other.samples)
        self.tokens += other.tokens

    def summary(self) -> dict[str, Any]:
        n = len(self.samples)
        total_ns = sum(self.samples)
        total_s = total_ns / 1e9
        return {
            "count": n,
            "tokens": self.tokens,
            "total_ms": total_ns / 1e6,
            "ops_per_s": n / total_s if total_s else None,
            "tokens_per_s": self.tokens / total_s if total_s and self.tokens else None,
            "mean_us": total_ns / n / 1e3 if n else None,
            "p50_us": percentile(self.samples, 0.50) / 1e3 if n else None,
            "p99_us": percentile(self.samples, 0.99) / 1e3 if n else None,
            "max_us": max(self.samples) / 1e3 if n else None,
        }


def timer_overhead_ns(n: int = 20_000) -> float:
    """Median cost of one back-to-back perf_counter_ns pair, included in every sample."""
    samples = []
    for _ in range(n):
        t0 = now_ns()
        samples.append(now_ns() - t0)
    return percentile(samples, 0.5)


# ---------------------------------------------------------------------------------------------- recording
def _encode_steps(steps: dict[str, float]) -> dict[str, float | None]:
    return {a: (None if math.isinf(e) else e) for a, e in steps.items()}  # JSON has no infinity


def _decode_steps(steps: dict[str, float | None]) -> dict[str, float]:
    return {a: (math.inf if e is None else e) for a, e in steps.items()}


@contextlib.contextmanager
def recording(events: list[dict[str, Any]], scenario: str) -> Iterator[None]:
    """Record what the replicas are asked to do; restores the simulator classes afterwards."""
    orig_submit, orig_publish, orig_retire = SimReplica.submit, Simulation.publish, Simulation.retire

    def submit(self: SimReplica, req: SimRequest) -> None:
        events.append({"kind": "request", "scenario": scenario, "workflow": req.workflow, "agent": req.agent,
                       "fixed_len": req.fixed_len, "tokens": list(req.tokens), "output": list(req.output_tokens)})
        orig_submit(self, req)

    def publish(self: Simulation, workflow: str, steps: Mapping[str, float]) -> None:
        events.append({"kind": "steps", "scenario": scenario, "workflow": workflow,
                       "steps": _encode_steps(dict(steps))})
        orig_publish(self, workflow, steps)

    def retire(self: Simulation, workflow: str) -> None:
        events.append({"kind": "retire", "scenario": scenario, "workflow": workflow})
        orig_retire(self, workflow)

    SimReplica.submit = submit  # type: ignore[method-assign]
    Simulation.publish = publish  # type: ignore[method-assign]
    Simulation.retire = retire  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimReplica.submit = orig_submit  # type: ignore[method-assign]
        Simulation.publish = orig_publish  # type: ignore[method-assign]
        Simulation.retire = orig_retire  # type: ignore[method-assign]


def record_traces(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Run the scenarios through the simulator, write every recorded event as a JSON line."""
    profile = load_profile(args.profile)
    scenarios = [
        ("peer", workload.peer(clients=args.peer_clients)),
        ("single", workload.single(fixed=args.single_fixed, iterations=args.single_iterations)),
    ]
    info: dict[str, Any] = {"path": str(path), "record_policy": args.record_policy, "profile": profile.name,
                            "scenarios": {}}
    with path.open("w") as f:
        for name, scenario in scenarios:
            events: list[dict[str, Any]] = []
            t0 = time.perf_counter()
            with recording(events, name):
                result, _sim = simulate(scenario, profile, args.record_policy)
            requests = [e for e in events if e["kind"] == "request"]
            info["scenarios"][name] = {
                "params": scenario.params,
                "events": len(events),
                "requests": len(requests),
                "prompt_tokens": sum(len(e["tokens"]) for e in requests),
                "output_tokens": sum(len(e["output"]) for e in requests),
                "max_request_tokens": max(len(e["tokens"]) + len(e["output"]) for e in requests),
                "sim_wall_s": time.perf_counter() - t0,
                "sim_gpu_hit_ratio": result["gpu_hit_ratio"],
            }
            for event in events:
                f.write(json.dumps(event, separators=(",", ":")) + "\n")
    info["bytes"] = path.stat().st_size
    return info


def load_trace(path: Path) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = {}
    with path.open() as f:
        for line in f:
            event = json.loads(line)
            if event["kind"] == "request":
                event["tokens"] = tuple(event["tokens"])
                event["output"] = tuple(event["output"])
            elif event["kind"] == "steps":
                event["steps"] = _decode_steps(event["steps"])
            traces.setdefault(event["scenario"], []).append(event)
    return traces


# ---------------------------------------------------------------------------------------------- replay
def _retire(cache: TieredCache, book: StepBook, workflow: str) -> None:
    book.retire(workflow)
    retire_workflow = getattr(cache, "retire_workflow", None)
    if retire_workflow is not None:
        retire_workflow(workflow)
    else:
        cache.tree.untag_workflow(workflow)


def replay(events: list[dict[str, Any]], policy_name: str, gpu_tokens: int, cpu_tokens: int,
           tick: Callable[[], None]) -> tuple[dict[str, OpStats], dict[str, Any]]:
    """One pass over a recorded trace against a fresh cache; returns per-op stats and cache outcomes."""
    book = StepBook(near_horizon=2)
    cache = TieredCache(gpu_tokens, make_eviction_policy(policy_name, book), cpu_capacity=cpu_tokens,
                        host_tier=True)
    tree = cache.tree
    counters = cache.counters
    ops = {op: OpStats() for op in REPLAY_OPS}
    prompt_tokens = device_hit = host_hit = 0
    wall0 = time.perf_counter()
    for event in events:
        kind = event["kind"]
        if kind == "steps":
            t0 = now_ns()
            book.set_steps(event["workflow"], event["steps"])
            ops["hint"].add(now_ns() - t0)
            continue
        if kind == "retire":
            t0 = now_ns()
            _retire(cache, book, event["workflow"])
            ops["retire"].add(now_ns() - t0)
            continue
        tokens: tuple[int, ...] = event["tokens"]
        output: tuple[int, ...] = event["output"]
        tag = (event["workflow"], event["agent"])
        if event["fixed_len"] and book.prompt(tag) is None:  # the simulator registers prompts up front
            book.register_prompt(tag, tokens[:event["fixed_len"]])

        t0 = now_ns()
        match = cache.match(tokens)
        ops["match"].add(now_ns() - t0, len(tokens))
        ready, loading, host = match.split_by_tier()
        assert not loading, "the replay completes every load at once"
        prompt_tokens += len(tokens)
        device_hit += ready
        host_hit += match.length - ready

        t0 = now_ns()
        tree.lock(match.last)
        ops["lock"].add(now_ns() - t0)

        private = len(tokens) - match.length + len(output)
        host_need = sum(len(node.key) for node in host)
        need = private + host_need
        for _attempt in range(10_000):
            before = counters.evicted_gpu_tokens + counters.written_back_tokens
            host_before = counters.evicted_cpu_tokens
            t0 = now_ns()
            ok, writebacks = cache.make_room(need)
            dt = now_ns() - t0
            evicted = counters.evicted_gpu_tokens + counters.written_back_tokens - before
            if evicted:
                ops["evict"].add(dt, evicted)
                if counters.evicted_cpu_tokens > host_before:
                    ops["evict_host_full"].add(dt, evicted)
            else:
                ops["make_room_noop"].add(dt)
            for node in writebacks:  # the engine's device -> host copy completes right away
                t0 = now_ns()
                cache.finish_offload(node)
                ops["offload_done"].add(now_ns() - t0)
            if ok:
                break
            if not writebacks:
                raise RuntimeError(f"cannot make room for {need} tokens (free {cache.free_tokens}, "
                                   f"capacity {gpu_tokens}): raise --gpu-tokens")
        else:
            raise RuntimeError("make_room did not converge")

        if host:
            t0 = now_ns()
            cache.start_load(host)
            for node in host:
                cache.finish_load(node)
            ops["load"].add(now_ns() - t0, host_need)

        t0 = now_ns()
        cache.alloc(private)
        ops["alloc"].add(now_ns() - t0)

        sequence = tokens + output
        t0 = now_ns()
        cache.commit(sequence, private)
        ops["insert"].add(now_ns() - t0, len(sequence))

        if event["fixed_len"]:
            t0 = now_ns()
            tree.tag_prefix(tokens[:event["fixed_len"]], tag)
            ops["tag"].add(now_ns() - t0)

        t0 = now_ns()
        tree.unlock(match.last)
        ops["unlock"].add(now_ns() - t0)
        tick()
    wall = time.perf_counter() - wall0
    tree.check_invariants()
    outcome = {
        "wall_s": wall,
        "device_hit_ratio": device_hit / prompt_tokens if prompt_tokens else 0.0,
        "host_hit_ratio": host_hit / prompt_tokens if prompt_tokens else 0.0,
        "evicted_gpu_tokens": counters.evicted_gpu_tokens,
        "written_back_tokens": counters.written_back_tokens,
        "evicted_cpu_tokens": counters.evicted_cpu_tokens,
        "dropped_tokens": counters.dropped_tokens,
        "final_nodes": sum(1 for _ in tree.nodes()),
    }
    return ops, outcome


def run_replays(args: argparse.Namespace, traces: dict[str, list[dict[str, Any]]],
                bar: tqdm) -> list[dict[str, Any]]:
    results = []
    for trace_name, events in traces.items():
        n_requests = sum(1 for e in events if e["kind"] == "request")
        for policy in args.policies:
            bar.set_postfix_str(f"replay {trace_name}/{policy}")
            pooled = {op: OpStats() for op in REPLAY_OPS}
            outcomes = []
            for _ in range(args.repeat):
                gc.collect()
                ops, outcome = replay(events, policy, args.gpu_tokens, args.cpu_tokens, lambda: bar.update(1))
                for op, stats in ops.items():
                    pooled[op].extend(stats)
                outcomes.append(outcome)
            first = outcomes[0]
            results.append({
                "trace": trace_name,
                "policy": policy,
                "requests": n_requests,
                "repeat": args.repeat,
                "wall_s_per_pass": [o["wall_s"] for o in outcomes],
                "requests_per_s": n_requests / min(o["wall_s"] for o in outcomes),
                "cache": {k: v for k, v in first.items() if k != "wall_s"},
                "ops": {op: stats.summary() for op, stats in pooled.items() if stats.samples},
            })
    return results


# ---------------------------------------------------------------------------------------------- priority updates
class TokenIds:
    def __init__(self, start: int) -> None:
        self.next = start

    def fresh(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


def priority_updates(args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    W, A, P, pre = args.workflows, args.agents, args.prompt_tokens, args.preamble
    if not 0 < pre < P:
        raise SystemExit("--preamble must be positive and shorter than --prompt-tokens")
    names = [f"agent{i}" for i in range(A)]
    spec = workload.sequential_loop("loop", names)
    book = StepBook(near_horizon=2)
    policy = KVFlowPolicy(book)
    capacity = pre + W * A * (P - pre)  # exactly what the prompts need: every make_room must evict
    cache = TieredCache(capacity, policy)
    tree = cache.tree
    ids = TokenIds(1)
    preamble = ids.fresh(pre)

    bar.set_postfix_str("build 1k-workflow tree")
    t_build = time.perf_counter()
    states: list[WorkflowState] = []
    current: list[int] = []
    keys = [f"loop/{w}" for w in range(W)]
    for w, wf in enumerate(keys):
        running = w % A  # spread the workflows over the loop
        state = WorkflowState(spec, running=[names[running]])
        states.append(state)
        current.append(running)
        book.set_steps(wf, state.steps_to_execution())
        for agent in names:
            prompt = preamble + ids.fresh(P - pre)
            matched = cache.match(prompt).length
            cache.alloc(len(prompt) - matched)
            cache.commit(prompt, len(prompt) - matched)
            tree.tag_prefix(prompt, (wf, agent))
            book.register_prompt((wf, agent), prompt)
        bar.update(1)
    build_s = time.perf_counter() - t_build
    shared = tree.match_prefix(preamble, split=False).path[-1]
    assert len(shared.tags) == W * A, len(shared.tags)
    assert cache.free_tokens == 0, cache.free_tokens
    gc.collect()

    def advance(w: int) -> None:
        state = states[w]
        cur = names[current[w]]
        nxt = (current[w] + 1) % A
        state.finish(cur)
        state.start(names[nxt])
        book.set_steps(keys[w], state.steps_to_execution())
        current[w] = nxt

    # (a) one agent transition per workflow, every workflow, `update_rounds` times
    update = OpStats()
    round_ms: list[float] = []
    for r in range(args.update_rounds):
        bar.set_postfix_str(f"updates round {r + 1}")
        t_round = now_ns()
        for w in range(W):
            t0 = now_ns()
            advance(w)
            update.add(now_ns() - t0)
        round_ms.append((now_ns() - t_round) / 1e6)
        bar.update(W)

    # (b) eviction decision right after an update, on a sample of workflows
    first, repeat, lru = OpStats(), OpStats(), OpStats()
    shared_first, shared_cached = OpStats(), OpStats()
    leaves_seen: list[int] = []
    lru_policy = LRUPolicy()
    step = max(1, W // args.evict_samples)
    sample = list(range(0, W, step))[:args.evict_samples]
    bar.set_postfix_str("eviction after update")
    for w in sample:
        advance(w)  # invalidates every cached distance (the StepBook version is global)
        leaves_seen.append(len(tree.gpu_leaves))
        freed = cache.free_tokens
        t0 = now_ns()
        ok, _ = cache.make_room(cache.free_tokens + 1)
        first.add(now_ns() - t0, cache.free_tokens - freed)
        assert ok
        freed = cache.free_tokens
        t0 = now_ns()
        cache.make_room(cache.free_tokens + 1)  # no update in between: cached distances are valid
        repeat.add(now_ns() - t0, cache.free_tokens - freed)
        cache.eviction = lru_policy  # same tree, same leaves, no distances at all
        freed = cache.free_tokens
        t0 = now_ns()
        cache.make_room(cache.free_tokens + 1)
        lru.add(now_ns() - t0, cache.free_tokens - freed)
        cache.eviction = policy
        t0 = now_ns()
        policy.node_distance(shared)  # stale since the update: min over every tag
        shared_first.add(now_ns() - t0)
        t0 = now_ns()
        policy.node_distance(shared)
        shared_cached.add(now_ns() - t0)
        bar.update(1)

    # (c) retiring every workflow (StepBook.retire + untagging its nodes, shared preamble included)
    book_retire, untag = OpStats(), OpStats()
    bar.set_postfix_str("retire")
    for wf in keys:
        t0 = now_ns()
        book.retire(wf)
        book_retire.add(now_ns() - t0)
        t0 = now_ns()
        tree.untag_workflow(wf)
        untag.add(now_ns() - t0)
        bar.update(1)
    tree.check_invariants()

    upd = update.summary()
    return {
        "config": {"workflows": W, "agents": A, "prompt_tokens": P, "shared_preamble": pre,
                   "device_tokens": capacity, "update_rounds": args.update_rounds,
                   "evict_samples": len(sample)},
        "build_s": build_s,
        "shared_node_tags": W * A,
        "update": {**upd, "all_workflows_ms_per_round": round_ms,
                   "all_workflows_ms_median": percentile(round_ms, 0.5)},
        "evict_first_after_update": first.summary(),
        "evict_repeat_no_update": repeat.summary(),
        "evict_lru_same_tree": lru.summary(),
        "device_leaves": {"min": min(leaves_seen), "max": max(leaves_seen)} if leaves_seen else None,
        "shared_node_distance_after_update": shared_first.summary(),
        "shared_node_distance_cached": shared_cached.summary(),
        "retire_stepbook": book_retire.summary(),
        "retire_untag_workflow": untag.summary(),
    }


# ---------------------------------------------------------------------------------------------- output
def _f(value: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def print_table(report: dict[str, Any], out: Any = sys.stdout) -> None:
    def p(line: str = "") -> None:
        print(line, file=out)

    env = report["environment"]
    p(f"kvflow_ray core micro-benchmarks  (python {env['python']}, {env['cpus']} CPUs, load average "
      f"{env['load_average_at_start'][0]:.2f} at start, timer overhead {env['timer_overhead_ns']:.0f} ns/sample)")
    contended = report["runtime_s"] > 1.3 * report["cpu_s"]
    p(f"runtime {report['runtime_s']:.1f} s wall, {report['cpu_s']:.1f} s CPU"
      + ("  (wall >> CPU: other processes competed for the cores; tails include their time slices)"
         if contended else ""))
    tr = report["trace"]
    p()
    p(f"1. Replay of recorded simulator traces (recorded under policy {tr['record_policy']!r}, "
      f"profile {tr['profile']}; {tr['bytes'] / 1e6:.1f} MB JSONL)")
    for name, s in tr["scenarios"].items():
        p(f"   {name:6s}: {s['requests']} requests, {s['events']} events, {s['prompt_tokens']:,} prompt + "
          f"{s['output_tokens']:,} output tokens, params {s['params']}")
    cfg = report["config"]
    p(f"   replay cache: device {cfg['gpu_tokens']:,} tokens, host tier {cfg['cpu_tokens']:,} tokens, "
      f"{cfg['repeat']} pass(es) per trace x policy, samples pooled")
    p()
    header = (f"   {'trace':6s} {'policy':6s} {'op':15s} {'count':>7s} {'ops/s':>11s} {'tokens/s':>13s} "
              f"{'p50 us':>9s} {'p99 us':>9s} {'max us':>9s}")
    p(header)
    p("   " + "-" * (len(header) - 3))
    for r in report["replay"]:
        for op in (*HEADLINE_OPS, *(o for o in REPLAY_OPS if o not in HEADLINE_OPS)):
            s = r["ops"].get(op)
            if s is None:
                continue
            p(f"   {r['trace']:6s} {r['policy']:6s} {op:15s} {s['count']:7d} {_f(s['ops_per_s'], '{:,.0f}'):>11s} "
              f"{_f(s['tokens_per_s'], '{:,.0f}'):>13s} {_f(s['p50_us'], '{:,.2f}'):>9s} "
              f"{_f(s['p99_us'], '{:,.2f}'):>9s} {_f(s['max_us'], '{:,.0f}'):>9s}")
        c = r["cache"]
        p(f"   {'':13s} -> {r['requests_per_s']:,.0f} req/s end to end; device hits {c['device_hit_ratio']:.1%}, "
          f"host hits {c['host_hit_ratio']:.1%}; written back {c['written_back_tokens']:,}, "
          f"device freed {c['evicted_gpu_tokens']:,}, host freed {c['evicted_cpu_tokens']:,} tokens")
        p()
    p("   ops: " + "; ".join(f"{op} = {doc}" for op, doc in REPLAY_OP_DOC.items() if op in HEADLINE_OPS))
    p("   ops/s and tokens/s are over the time spent in that operation only (sum of its samples).")

    pu = report["priority_update"]
    c = pu["config"]
    p()
    p(f"2. Priority updates: {c['workflows']:,} workflows x {c['agents']} agents (sequential loop), "
      f"{c['prompt_tokens']}-token prompts sharing a {c['shared_preamble']}-token preamble "
      f"({pu['shared_node_tags']:,} tags on the shared node); tree built in {pu['build_s']:.2f} s")
    u = pu["update"]
    p(f"   (a) agent transition (finish+start+steps_to_execution+set_steps): p50 {_f(u['p50_us'], '{:.2f}')} us, "
      f"p99 {_f(u['p99_us'], '{:.2f}')} us; all {c['workflows']:,} workflows: "
      f"{u['all_workflows_ms_median']:.2f} ms (median of {c['update_rounds']} rounds)")
    leaves = pu["device_leaves"]
    p(f"   (b) eviction decision, one make_room evicting one prompt leaf ({c['evict_samples']} samples, "
      f"{leaves['min']:,}-{leaves['max']:,} device leaves):")
    for label, key in (("first after an update (kvflow)", "evict_first_after_update"),
                       ("repeat, no update (kvflow)", "evict_repeat_no_update"),
                       ("same tree, lru policy", "evict_lru_same_tree"),
                       ("shared-node distance after update", "shared_node_distance_after_update"),
                       ("shared-node distance, cached", "shared_node_distance_cached")):
        s = pu[key]
        p(f"       {label:36s} p50 {_f(s['p50_us'], '{:>10,.1f}')} us   p99 {_f(s['p99_us'], '{:>10,.1f}')} us")
    for label, key in (("StepBook.retire", "retire_stepbook"), ("RadixTree.untag_workflow", "retire_untag_workflow")):
        s = pu[key]
        p(f"   (c) {label:36s} p50 {_f(s['p50_us'], '{:>10,.1f}')} us   p99 {_f(s['p99_us'], '{:>10,.1f}')} us   "
          f"all: {s['total_ms']:,.1f} ms")


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/core_micro.py",
        description="Micro-benchmarks of kvflow_ray/core: insert/match/evict throughput on a recorded simulator "
                    "trace, and the cost of priority updates for many concurrent workflows.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the table")
    ap.add_argument("--out", type=Path, help="also write the JSON report to this file")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g = ap.add_argument_group("1. recorded-trace replay")
    g.add_argument("--profile", default="h100-llama3.1-8b", help="simulator profile for the recording runs")
    g.add_argument("--record-policy", default="kvflow", help="simulator policy of the recording runs")
    g.add_argument("--peer-clients", type=int, default=64, help="workload.peer(clients=...)")
    g.add_argument("--single-fixed", type=int, default=2048, help="workload.single(fixed=...)")
    g.add_argument("--single-iterations", type=int, default=3, help="workload.single(iterations=...)")
    g.add_argument("--trace-out", type=Path, help="keep the recorded JSONL trace here (default: a temp dir)")
    g.add_argument("--policies", default="lru,kvflow", help="eviction policies to replay with")
    g.add_argument("--gpu-tokens", type=int, default=16384, help="replay device capacity (forces eviction)")
    g.add_argument("--cpu-tokens", type=int, default=65536, help="replay host-tier capacity")
    g.add_argument("--repeat", type=int, default=5, help="replay passes per trace x policy (fresh cache each)")
    g = ap.add_argument_group("2. priority updates")
    g.add_argument("--workflows", type=int, default=1000)
    g.add_argument("--agents", type=int, default=10)
    g.add_argument("--prompt-tokens", type=int, default=256)
    g.add_argument("--preamble", type=int, default=64, help="tokens shared by every prompt of every workflow")
    g.add_argument("--update-rounds", type=int, default=3, help="agent transitions per workflow in (a)")
    g.add_argument("--evict-samples", type=int, default=100, help="workflows sampled for the eviction timing (b)")
    args = ap.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in args.policies:
        if p not in ("lru", "kvflow"):
            ap.error(f"--policies: {p!r} is not lru or kvflow")
    for name in ("peer_clients", "single_fixed", "single_iterations", "gpu_tokens", "cpu_tokens", "repeat",
                 "workflows", "agents", "prompt_tokens", "update_rounds", "evict_samples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    cpu_start = time.process_time()
    # tqdm's monitor thread would take the GIL in the middle of timed operations
    tqdm.monitor_interval = 0
    report: dict[str, Any] = {
        "benchmark": "core_micro",
        "environment": {"python": platform.python_version(), "implementation": platform.python_implementation(),
                        "machine": platform.machine(), "cpus": os.cpu_count(),
                        "load_average_at_start": list(os.getloadavg()),
                        "timer_overhead_ns": timer_overhead_ns()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    with contextlib.ExitStack() as stack:
        if args.trace_out is not None:
            trace_path = args.trace_out
            trace_path.parent.mkdir(parents=True, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvflow-core-micro-"))
            trace_path = Path(tmp) / "trace.jsonl"
        bar = stack.enter_context(tqdm(total=2, desc="record", unit="step", file=sys.stderr,
                                       disable=args.no_progress, dynamic_ncols=True))
        bar.set_postfix_str("simulate + record")
        report["trace"] = info = record_traces(args, trace_path)
        bar.update(2)
        bar.close()
        traces = load_trace(trace_path)
        if args.trace_out is None:
            info["path"] = None  # the temp dir is gone when the report is read

    total = sum(s["requests"] for s in info["scenarios"].values()) * len(args.policies) * args.repeat
    with tqdm(total=total, desc="replay", unit="req", file=sys.stderr, disable=args.no_progress,
              dynamic_ncols=True) as bar:
        report["replay"] = run_replays(args, traces, bar)
    del traces
    gc.collect()

    n_samples = min(args.evict_samples, args.workflows)
    total = args.workflows * (2 + args.update_rounds) + n_samples
    with tqdm(total=total, desc="priority", unit="op", file=sys.stderr, disable=args.no_progress,
              dynamic_ncols=True) as bar:
        report["priority_update"] = priority_updates(args, bar)

    report["runtime_s"] = time.perf_counter() - t_start
    report["cpu_s"] = time.process_time() - cpu_start
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
