"""Soak: many workflow instances through the whole stack, watching for what grows and never shrinks.

The stack: local Ray, the app on simulated A10G replicas (`engine: sim`, a short time scale, so engine
compute costs next to no CPU here), the workflow router on its own redis-server (started here, no
persistence, unless --redis names one), short state and template TTLs. C client threads drive N
workflow instances over HTTP through the SDK (`Workflow` / `WorkflowRun`, so through the OpenAI SDK),
each instance one of:
- plain (most): one pass of the shared PEER template (its stages, `iteration_stages`), then finish;
- abandoned (--abandon): its entry agent only, never finished: the state TTL must expire it;
- unique (--unique): a template of its own (PEER with a unique ~6 KB preamble before every agent's
  prompt, registered under a unique name, never reused): the template idle TTL must drop it;
- re-register (--reregister): first registers a changed revision of the shared template (while other
  clients of it are live), then runs a pass on it and finishes.
Any non-2xx answer is a failure, counted by operation and status.

A sampler records every --sample-s seconds (and when the first 1,000 workflows are done): the RSS
and CPU time of each process (the router actor, every engine replica, the ingress, Serve's controller
and proxy, Ray's GCS and raylet, redis-server, this driver), Redis `dbsize`, `used_memory` and its
keys by kind (a SCAN), and the router's `stats()` (CPU seconds, start/end calls, recent finish_client
latencies, live clients, templates). After the load it waits out the TTLs (abandoned clients and
unique templates must go), samples once more and reports, against the acceptance of issue 13
(reported, not asserted):
- each process's RSS at the end (the larger of end-of-load and after-expiry) is within 10% of its
  RSS after the first 1,000 workflows (the first 10% when N < 10,000);
- Redis keys after expiry are about live clients + cached prefixes (`kvflow:loc:*`): anything else
  beyond the replicas' heartbeats and the shared template is reported as left over;
- finish_client p99 (inside the router) <= 1 ms in every sample window, whatever the live-client count;
- router CPU per agent call (its CPU seconds / its start_call count) <= 1 ms.
Writes soak.json and a plot of memory over time (soak.png) into --out (default benchmarks/out).

    python benchmarks/soak.py                         # 10,000 workflows (~25 min on 2 cores)
    python benchmarks/soak.py --workflows 300 --ttl-s 10 --out /tmp/soak/soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package is this checkout
    sys.path.insert(0, str(ROOT))
import results_file  # noqa: E402 (benchmarks/, beside this script)
from local_cluster import Processes, free_port  # noqa: E402 (beside this script)

from kvflow_ray.core.stats import percentile  # noqa: E402

TENANT = "default"  # no API keys: the one tenant
KINDS = ("plain", "abandoned", "unique", "reregister")
MB = 1 << 20
# stats() ints that are not sizes of the router's state
ROUTER_COUNTERS = {"pid", "start_calls", "end_calls", "first_tokens"}


def ms(seconds: float | None, digits: int = 3) -> float | None:
    return None if seconds is None else round(1e3 * seconds, digits)


# ---------------------------------------------------------------------------------------------- redis
@contextlib.contextmanager
def local_redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server on a free loopback port, no persistence (as tests/conftest.py starts it)."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server), or pass --redis URL")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="soak-redis-") as workdir:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            client = redis.Redis(host="127.0.0.1", port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit(f"redis-server did not start on port {port}") from None
                    time.sleep(0.05)
            client.close()
            yield f"redis://127.0.0.1:{port}/0", proc
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def key_kind(key: str) -> str:
    """What a store key holds (kvflow_ray/router/store.py's layout)."""
    parts = key.split(":")
    if parts == ["kvflow", "router"]:
        return "marker"  # written once: its absence tells the router the store lost its data
    if len(parts) < 3 or parts[0] != "kvflow":
        return "other"
    if parts[1] in ("loc", "replica"):
        return parts[1]
    if len(parts) >= 4 and parts[2] == "template":
        return "template_version" if "@" in parts[3] else "template"
    if len(parts) >= 4 and parts[2] == "client":
        return "client"
    return "other"


# ---------------------------------------------------------------------------------------------- the workload
def shared_revision(peer: Any, revision: int) -> Any:
    """The shared template at `revision` (0: PEER as is, renamed); later ones change the planner's prompt."""
    from kvflow_ray.client import Workflow

    data = peer.spec.to_dict()
    data["name"] = "soak-peer"
    if revision:
        data["agents"]["planner"]["prompt"] = (data["agents"]["planner"].get("prompt") or "") + \
            f"\nRevision {revision}: keep each sub-question under twenty words."
    return Workflow.from_dict(data)


def unique_variant(peer: Any, index: int, preamble_chars: int, salt: str) -> Any:
    """PEER under a name of its own, a unique preamble before every agent's prompt (never reused)."""
    from kvflow_ray.client.loadgen import with_preamble

    return with_preamble(peer, f"soak-u{index}-{salt}", f"Handbook {salt}-{index}: ", f"{salt}-{index}",
                         preamble_chars)


def plan(n: int, abandon: float, unique: float, reregister: float, seed: int) -> list[str]:
    """The kind of each of the `n` workflow instances: exact shares, shuffled."""
    counts = {"abandoned": round(n * abandon), "unique": round(n * unique), "reregister": round(n * reregister)}
    kinds = [k for k, c in counts.items() for _ in range(c)][:n]
    kinds += ["plain"] * (n - len(kinds))
    random.Random(seed).shuffle(kinds)
    return kinds


def _status(exc: BaseException) -> int:
    """The HTTP status of a failed SDK call (0: no answer at all)."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, int):
        return code
    found = re.search(r"HTTP (\d{3})", str(exc))
    return int(found.group(1)) if found else 0


class Load:
    """The client side: C threads over N workflow instances, with the counters the sampler reads."""

    def __init__(self, args: argparse.Namespace, base_url: str, kinds: list[str]) -> None:
        from kvflow_ray.client import Workflow
        from kvflow_ray.client.loadgen import iteration_stages

        self.args, self.base_url, self.kinds = args, base_url.rstrip("/"), kinds
        self.peer = Workflow.from_yaml(ROOT / "workflows" / "peer.yaml")
        self.stages = iteration_stages(self.peer)
        self.salt = f"{os.getpid()}{int(time.time())}"
        self.lock = threading.Lock()
        self.revision = 0  # the latest revision of the shared template handed out
        self.shared = shared_revision(self.peer, 0)
        self.shared_revision = 0  # ... and the one new instances run
        self.next_index = 0
        self.done = 0  # workflow instances completed (an abandoned one after its call)
        self.calls = 0  # agent calls answered (2xx or not)
        self.finishes = 0  # finish_client answered 2xx
        self.finish_rtt: list[float] = []  # finish round trips seen here (HTTP + ingress + router)
        self.call_latency: list[float] = []  # agent calls answered 2xx, as seen here
        self.by_kind: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # "op status" -> count
        self.failure_examples: list[str] = []
        self.wake = threading.Event()  # wakes the sampler when `args.baseline_after` instances are done
        self.on_done: Any = None

    # the HTTP API for registration: the status is the result (SDK runs register only at construction)
    def register(self, workflow: Any) -> bool:
        request = urllib.request.Request(self.base_url + "/v1/workflows",
                                         data=json.dumps(workflow.spec.to_dict()).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.args.timeout_s) as response:
                response.read()
            return True
        except urllib.error.HTTPError as exc:
            self._fail("register", exc.code, exc.read().decode(errors="replace")[:300])
        except OSError as exc:
            self._fail("register", 0, str(exc))
        return False

    def _fail(self, op: str, status: int, message: str) -> None:
        with self.lock:
            self.failures[f"{op} {status}"] += 1
            if len(self.failure_examples) < 10:
                self.failure_examples.append(f"{op} {status}: {message[:300]}")

    def _call(self, run: Any, agent: str, index: int) -> bool:
        task = f"Soak task {index} for the {agent}: " + "check the quarterly filing; " * 8
        started = time.perf_counter()
        try:
            run.agent(agent).chat([{"role": "user", "content": task[:self.args.task_chars]}],
                                  max_tokens=self.args.max_tokens, temperature=0, extra_body={"ignore_eos": True})
        except Exception as exc:
            self._fail(f"call:{agent}", _status(exc), f"{type(exc).__name__}: {exc}")
            with self.lock:
                self.calls += 1
            return False
        with self.lock:
            self.calls += 1
            self.call_latency.append(time.perf_counter() - started)
        return True

    def _finish(self, run: Any) -> None:
        started = time.perf_counter()
        try:
            run.finish()
        except Exception as exc:
            self._fail("finish", _status(exc), f"{type(exc).__name__}: {exc}")
            return
        with self.lock:
            self.finishes += 1
            self.finish_rtt.append(time.perf_counter() - started)

    def one(self, run: Any, index: int, kind: str) -> None:
        """One workflow instance on this thread's `run` (re-pointed at the instance)."""
        workflow = self.shared
        if kind == "unique":
            workflow = unique_variant(self.peer, index, self.args.preamble_chars, self.salt)
            self.register(workflow)
        elif kind == "reregister":
            with self.lock:
                self.revision += 1
                revision = self.revision
            workflow = shared_revision(self.peer, revision)
            if self.register(workflow):
                with self.lock:  # later instances run the newest revision registered
                    if revision > self.shared_revision:
                        self.shared, self.shared_revision = workflow, revision
        run.workflow, run.client_id, run.finished = workflow, f"soak-{self.salt}-{index}-{kind[0]}", False
        if kind == "abandoned":
            self._call(run, self.stages[0][0], index)
        else:
            for stage in self.stages:  # PEER's stages are one agent each: sequential calls
                for agent in stage:
                    self._call(run, agent, index)
            self._finish(run)

    def worker(self) -> None:
        # One WorkflowRun per thread, re-pointed at each instance (workflow, client_id): building one
        # builds an OpenAI client (~35 ms of CPU for its TLS context), which at 10,000 instances would
        # be most of this driver's CPU, taken from the server on a small machine.
        run = self.shared.client(base_url=self.base_url + "/v1", register=False, timeout=self.args.timeout_s,
                                 max_retries=0)  # every failure counts
        try:
            while True:
                with self.lock:
                    index = self.next_index
                    if index >= len(self.kinds):
                        return
                    self.next_index += 1
                kind = self.kinds[index]
                self.one(run, index, kind)
                with self.lock:
                    self.done += 1
                    self.by_kind[kind] += 1
                    done = self.done
                if done == self.args.baseline_after:
                    self.wake.set()
                if self.on_done is not None:
                    self.on_done()
        finally:
            run.openai.close()

    def run(self) -> None:
        threads = [threading.Thread(target=self.worker, name=f"soak-client-{i}", daemon=True)
                   for i in range(self.args.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


# ---------------------------------------------------------------------------------------------- sampling
SOAK_ACTORS = (("WorkflowRouterActor", "router"), ("ServeReplica:kvflow:EngineReplica", "engine-replica"),
               ("ServeReplica:kvflow:Ingress", "ingress"), ("ServeController", "serve-controller"),
               ("ProxyActor", "serve-proxy"))


def watched_processes(redis_proc: subprocess.Popen[bytes] | None) -> Processes:
    """The soak's processes: the app's actors (engine replicas numbered), Ray's, Redis and the driver."""
    return Processes(SOAK_ACTORS, numbered=("engine-replica",),
                     extra={"redis-server": redis_proc.pid} if redis_proc is not None else None)


def process_roles(procs: Processes) -> dict[str, str]:
    return {"router": "app", "ingress": "app", "serve-controller": "ray", "serve-proxy": "ray",
            "gcs_server": "ray", "raylet": "ray", "redis-server": "redis", "driver": "client",
            **dict.fromkeys(procs.numbered_labels.values(), "app")}


class Sampler:
    def __init__(self, args: argparse.Namespace, load: Load, redis_url: str, procs: Processes) -> None:
        import redis

        self.args, self.load, self.procs = args, load, procs
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=10)
        self.router: Any = None
        self.samples: list[dict[str, Any]] = []
        self.finish_router: list[float] = []  # finish_client latencies inside the router, every window's
        self.finish_router_cpu: list[float] = []  # ... and the CPU time each took
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._prev: dict[str, Any] = {}
        self.baseline_index: int | None = None
        self.load_end_index: int | None = None

    def router_stats(self) -> dict[str, Any] | None:
        import ray

        from kvflow_ray.serve.router_actor import get_router

        try:
            if self.router is None:
                self.router = get_router(create=False)
            return ray.get(self.router.stats.remote(), timeout=30)
        except Exception as exc:  # a restarting router: this sample goes without
            print(f"note: router stats() failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            self.router = None
            return None

    def redis_state(self) -> dict[str, Any]:
        kinds: Counter[str] = Counter()
        unknown: list[str] = []
        for key in self.redis.scan_iter(count=1000):
            kind = key_kind(key)
            kinds[kind] += 1
            if kind == "other" and len(unknown) < 5:
                unknown.append(key[:100])
        out = {"dbsize": int(self.redis.dbsize()), "used_memory": int(self.redis.info("memory")["used_memory"]),
               "keys": dict(kinds)}
        if unknown:
            out["other_keys"] = unknown
        return out

    def sample(self, tag: str = "") -> dict[str, Any]:
        load = self.load
        with load.lock:
            done, calls, finishes = load.done, load.calls, load.finishes
            failures = sum(load.failures.values())
        rss, cpu, pids = self.procs.usage()
        stats = self.router_stats()
        entry: dict[str, Any] = {"t": round(time.monotonic() - self.started, 3), "tag": tag, "done": done,
                                 "calls": calls, "finishes": finishes, "failures": failures, "rss": rss,
                                 "cpu_s": cpu, "pid": pids, "redis": self.redis_state()}
        if stats is not None:
            seconds = [float(s) for s in stats.pop("finish_seconds")]
            cpu_seconds = [float(s) for s in stats.pop("finish_cpu_seconds")]
            new = finishes - self._prev.get("finishes", 0)
            window = seconds[-new:] if new > 0 else []
            self.finish_router += window
            self.finish_router_cpu += cpu_seconds[-new:] if new > 0 else []
            entry["router"] = stats
            entry["finish_window"] = {"n": len(window), "p50_ms": ms(percentile(window, 0.5, None), 4),
                                      "p99_ms": ms(percentile(window, 0.99, None), 4),
                                      "max_ms": ms(max(window) if window else None, 4)}
            router_cpu, starts = float(stats["cpu_s"]), int(stats["start_calls"])
            entry["live_clients"] = stats.get("live_clients")
        else:  # the router is restarting: its process's CPU and the agent calls this driver made
            router_cpu, starts = cpu.get("router", math.nan), calls
            entry["live_clients"] = entry["redis"]["keys"].get("client", 0)
        entry["router_cpu_s"], entry["router_start_calls"] = router_cpu, starts
        if self._prev and starts > self._prev["starts"]:
            entry["router_cpu_ms_per_call"] = round(1e3 * (router_cpu - self._prev["cpu"]) /
                                                    (starts - self._prev["starts"]), 4)
        self._prev = {"finishes": finishes, "cpu": router_cpu, "starts": starts}
        self.samples.append(entry)
        return entry

    def loop(self) -> None:
        while not self._stop.is_set():
            self.load.wake.wait(self.args.sample_s)  # the period, or woken early (the baseline, the end)
            self.load.wake.clear()
            if self._stop.is_set():
                return
            baseline = self.baseline_index is None and self.load.done >= self.args.baseline_after
            self.sample("baseline" if baseline else "")
            if baseline:
                self.baseline_index = len(self.samples) - 1

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.loop, name="soak-sampler", daemon=True)
        thread.start()
        return thread

    def stop(self, thread: threading.Thread) -> None:
        self._stop.set()
        self.load.wake.set()
        thread.join()


# ---------------------------------------------------------------------------------------------- reference points
def ray_call_floor(calls: int = 1000) -> dict[str, float]:
    """What one actor call costs the called actor's process on this machine with nothing else in it: an
    empty async method, like the router's, called back to back and all at once. The router cannot spend
    less per agent call than this per router call."""
    import ray

    @ray.remote(num_cpus=0, max_concurrency=1000)
    class Empty:
        async def call(self, *args: Any, **kwargs: Any) -> None:
            return None

        async def cpu(self) -> float:
            return time.process_time()

    actor = Empty.remote()  # type: ignore[attr-defined]
    try:
        ray.get([actor.call.remote() for _ in range(50)])  # warm
        before = ray.get(actor.cpu.remote())
        for _ in range(calls):
            ray.get(actor.call.remote("acme", "client-0", "planner", workflow="peer", prefix_hash="0" * 32))
        middle = ray.get(actor.cpu.remote())
        ray.get([actor.call.remote("acme", "client-0", "planner") for _ in range(calls)])
        after = ray.get(actor.cpu.remote())
    finally:
        ray.kill(actor)
    return {"sequential_ms": round(1e3 * (middle - before) / calls, 4),
            "pipelined_ms": round(1e3 * (after - middle) / calls, 4)}


def core_scale(counts: list[int], finishes: int = 1000) -> list[dict[str, Any]]:
    """finish_client of the router's core (`RouterCore`, the code the actor runs; no Ray, an in-process
    store written behind as in the actor) with this many live clients: p50/p99 of wall and CPU time.
    The soak's own load never holds more than a few dozen clients live at once."""
    from kvflow_ray.client import Workflow
    from kvflow_ray.router.core import RouterCore
    from kvflow_ray.router.store import BufferedStore, MemoryStore

    peer = Workflow.from_yaml(ROOT / "workflows" / "peer.yaml").spec
    out = []
    for count in counts:
        store = BufferedStore(MemoryStore())
        core = RouterCore(store)
        for replica in ("r1", "r2"):
            core.add_replica(replica)
        core.put_template("acme", peer.to_dict())
        core.limits.max_live_clients = count + 1
        for i in range(count):
            route = core.start_call("acme", f"c{i}", "planner", workflow=peer.name, prefix_hash=f"h{i % 50}",
                                    prefix_tokens=100)
            core.end_call("acme", f"c{i}", "planner", route.replica)
            if i % 1000 == 0:
                store.take()
                core.take_hints("r1"), core.take_hints("r2")
        store.take()
        core.take_hints("r1"), core.take_hints("r2")
        core.finish_seconds.clear()
        core.finish_cpu_seconds.clear()
        for i in range(0, count, max(1, count // finishes)):
            core.finish_client("acme", f"c{i}")
        wall, cpu = list(core.finish_seconds), list(core.finish_cpu_seconds)
        out.append({"live_clients": count, "finishes": len(wall), "p50_ms": ms(percentile(wall, 0.5, None), 4),
                    "p99_ms": ms(percentile(wall, 0.99, None), 4), "cpu_p99_ms": ms(percentile(cpu, 0.99, None), 4)})
    return out


# ---------------------------------------------------------------------------------------------- the report
def summarise(args: argparse.Namespace, load: Load, sampler: Sampler, wall: dict[str, float]) -> dict[str, Any]:
    samples = sampler.samples
    base = samples[sampler.baseline_index] if sampler.baseline_index is not None else samples[0]
    end_load = samples[sampler.load_end_index] if sampler.load_end_index is not None else samples[-1]
    final = samples[-1]
    roles = process_roles(sampler.procs)
    rss: dict[str, Any] = {}
    for label in sorted(final["rss"], key=lambda name: (["app", "redis", "ray", "client"].index(roles.get(name, "ray")),
                                                         name)):
        if label not in base["rss"]:
            continue
        b, e, f = base["rss"][label], end_load["rss"].get(label), final["rss"][label]
        worst = max(v for v in (e, f) if v is not None)
        rss[label] = {"role": roles.get(label, "ray"), "baseline_mb": round(b / MB, 1),
                      "load_end_mb": None if e is None else round(e / MB, 1), "final_mb": round(f / MB, 1),
                      "ratio": round(worst / b, 3), "within_10pct": worst <= 1.10 * b,
                      "pid_changed": base["pid"].get(label) != final["pid"].get(label)}
    keys = final["redis"]["keys"]
    live = final.get("live_clients") or 0
    # what may stay after the TTLs: live clients' state, cached prefixes' locations, the replicas'
    # heartbeats, the router's marker and the shared template (unless idle long enough to be dropped)
    allowed = {"loc": keys.get("loc", 0), "replica": keys.get("replica", 0), "marker": keys.get("marker", 0),
               "client": live, "template": 1}
    expected = sum(allowed.values())
    leftover = {k: v - allowed.get(k, 0) for k, v in keys.items() if v > allowed.get(k, 0)}
    windows = [s for s in samples if s.get("finish_window", {}).get("n")]
    worst_window = max(windows, key=lambda s: s["finish_window"]["p99_ms"], default=None)
    lives = [s["live_clients"] for s in samples if s.get("live_clients") is not None]
    start_sample = samples[0]
    calls = end_load["router_start_calls"] - start_sample["router_start_calls"]
    load_cpu = end_load["router_cpu_s"] - start_sample["router_cpu_s"]
    cpu_per_call = load_cpu / calls if calls > 0 else None
    idle_s = final["t"] - end_load["t"]
    idle_rate = (final["router_cpu_s"] - end_load["router_cpu_s"]) / idle_s if idle_s > 0 else None
    marginal = ((load_cpu - idle_rate * (end_load["t"] - start_sample["t"])) / calls
                if calls > 0 and idle_rate is not None else None)
    per_window = [s["router_cpu_ms_per_call"] for s in samples if "router_cpu_ms_per_call" in s]
    finish_all, finish_cpu = sampler.finish_router, sampler.finish_router_cpu
    return {
        "workflows": {"total": args.workflows, "done": load.done, "by_kind": dict(load.by_kind),
                      "agent_calls": load.calls, "finishes": load.finishes, "template_revisions": load.revision},
        "failures": {"total": sum(load.failures.values()), "by_op_status": dict(load.failures),
                     "examples": load.failure_examples},
        "wall_s": wall,
        "rss": rss,
        "rss_verdict": all(r["within_10pct"] for r in rss.values() if r["role"] in ("app", "redis")),
        "redis": {"keys_final": final["redis"]["dbsize"], "keys_by_kind_final": keys,
                  "keys_load_end": end_load["redis"]["dbsize"], "keys_max": max(s["redis"]["dbsize"] for s in samples),
                  "used_memory_mb": {"baseline": round(base["redis"]["used_memory"] / MB, 2),
                                     "load_end": round(end_load["redis"]["used_memory"] / MB, 2),
                                     "final": round(final["redis"]["used_memory"] / MB, 2)},
                  "live_clients_final": live, "loc_keys_final": keys.get("loc", 0),
                  "expected_final": expected, "left_over": leftover, "verdict": not leftover},
        "finish_client": {
            "source": "router stats()",
            "n": len(finish_all), "p50_ms": ms(percentile(finish_all, 0.5, None), 4),
            "p99_ms": ms(percentile(finish_all, 0.99, None), 4),
            # the work itself (the router thread's CPU time): the wall time above also holds the
            # moments the router was descheduled, two cores being shared by every process here
            "cpu_p50_ms": ms(percentile(finish_cpu, 0.5, None), 4),
            "cpu_p99_ms": ms(percentile(finish_cpu, 0.99, None), 4),
            "worst_window_p99_ms": worst_window["finish_window"]["p99_ms"] if worst_window else None,
            "worst_window_live_clients": worst_window.get("live_clients") if worst_window else None,
            "live_clients_range": [min(lives), max(lives)] if lives else None,
            "verdict": (worst_window["finish_window"]["p99_ms"] <= 1.0) if worst_window else None,
            "round_trip_ms": {"p50": ms(percentile(load.finish_rtt, 0.5, None)),
                              "p99": ms(percentile(load.finish_rtt, 0.99, None))}},
        "router_cpu": {"source": "router stats()",
                       "start_calls": calls, "ms_per_call": ms(cpu_per_call, 4),
                       "max_window_ms_per_call": max(per_window) if per_window else None,
                       # the router's CPU with no calls (after the load: heartbeats, hint polls, upkeep,
                       # this sampler), and the mean per call once that background is taken out
                       "idle_ms_per_s": ms(idle_rate, 2), "marginal_ms_per_call": ms(marginal, 4),
                       "verdict": None if cpu_per_call is None else cpu_per_call <= 1e-3},
        "agent_call_ms": {"p50": ms(percentile(load.call_latency, 0.5, None)),
                          "p99": ms(percentile(load.call_latency, 0.99, None))},
        "router_final": final.get("router"),
    }


def print_summary(summary: dict[str, Any]) -> None:
    w, f = summary["workflows"], summary["failures"]
    print(f"workflows: {w['done']}/{w['total']} done {w['by_kind']}, {w['agent_calls']} agent calls, "
          f"{w['finishes']} finishes, {w['template_revisions']} template revisions; failures: {f['total']} "
          f"{f['by_op_status'] or ''}")
    print(f"wall: {summary['wall_s']}")
    print(f"\n{'process':<20} {'role':<7} {'baseline MB':>11} {'load end MB':>11} {'final MB':>9} {'ratio':>6}  ok")
    for label, r in summary["rss"].items():
        flag = ("yes" if r["within_10pct"] else "NO") + (" (restarted)" if r["pid_changed"] else "")
        load_end = "-" if r["load_end_mb"] is None else f"{r['load_end_mb']:.1f}"
        print(f"{label:<20} {r['role']:<7} {r['baseline_mb']:>11.1f} {load_end:>11} {r['final_mb']:>9.1f} "
              f"{r['ratio']:>6.3f}  {flag}")
    print(f"RSS within 10% (app + redis processes): {summary['rss_verdict']}")
    r = summary["redis"]
    print(f"\nredis keys: final {r['keys_final']} (by kind {r['keys_by_kind_final']}), load end {r['keys_load_end']}, "
          f"max {r['keys_max']}; expected at most {r['expected_final']} = live clients {r['live_clients_final']} + "
          f"loc {r['loc_keys_final']} + heartbeats + marker + shared template; left over "
          f"{r['left_over'] or 'nothing'}; used_memory MB {r['used_memory_mb']}; ok: {r['verdict']}")
    fc = summary["finish_client"]
    print(f"finish_client ({fc['source']}): n {fc['n']}, p50 {fc['p50_ms']} ms, p99 {fc['p99_ms']} ms, worst window "
          f"p99 {fc['worst_window_p99_ms']} ms (at {fc['worst_window_live_clients']} live clients; live range "
          f"{fc['live_clients_range']}); round trip from here p50 {fc['round_trip_ms']['p50']} ms p99 "
          f"{fc['round_trip_ms']['p99']} ms; ok (p99 <= 1 ms): {fc['verdict']}; CPU time p50 {fc['cpu_p50_ms']} ms "
          f"p99 {fc['cpu_p99_ms']} ms")
    for row in fc["core_at_scale"]:
        print(f"  router core, {row['live_clients']:>6} live clients: finish_client p50 {row['p50_ms']} ms, "
              f"p99 {row['p99_ms']} ms (CPU p99 {row['cpu_p99_ms']} ms) over {row['finishes']} finishes")
    rc = summary["router_cpu"]
    print(f"router CPU per agent call ({rc['source']}): {rc['ms_per_call']} ms mean over {rc['start_calls']} calls, "
          f"worst window {rc['max_window_ms_per_call']} ms; ok (<= 1 ms): {rc['verdict']}; idle it uses "
          f"{rc['idle_ms_per_s']} ms/s, so {rc['marginal_ms_per_call']} ms per call beyond that; one empty Ray "
          f"actor call costs its actor {rc['ray_actor_call_floor_ms']['sequential_ms']} ms back to back, "
          f"{rc['ray_actor_call_floor_ms']['pipelined_ms']} ms pipelined")
    print(f"agent calls from here: p50 {summary['agent_call_ms']['p50']} ms, p99 {summary['agent_call_ms']['p99']} ms")
    print(f"router state at the end: {summary['router_final']}")
    if f["examples"]:
        print("first failures:\n  " + "\n  ".join(f["examples"]))


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = out["samples"]
    t = [s["t"] for s in samples]
    fig, (top, bottom, state) = plt.subplots(3, 1, figsize=(12, 10), sharex=True,
                                             gridspec_kw={"height_ratios": [3, 2, 2]})
    labels = sorted({label for s in samples for label in s["rss"]})
    for label in labels:
        top.plot(t, [s["rss"].get(label, math.nan) / MB for s in samples], label=label, lw=1.4)
    top.set_ylabel("RSS (MB)")
    top.set_title(f"Soak: {out['summary']['workflows']['done']} workflows "
                  f"(sim, {out['setup']['replicas']} replicas, TTL {out['setup']['state_ttl_s']:g} s)")
    outside: dict[str, Any] = {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.09, 1)}
    top.legend(**outside)
    top.grid(alpha=0.3)
    bottom.plot(t, [s["redis"]["dbsize"] for s in samples], color="black", lw=1.6, label="redis keys (all)")
    for kind, style in (("client", "--"), ("loc", ":"), ("template", "-."), ("template_version", "-.")):
        bottom.plot(t, [s["redis"]["keys"].get(kind, 0) for s in samples], ls=style, lw=1, label=f"{kind} keys")
    bottom.set_ylabel("Redis keys")
    bottom.grid(alpha=0.3)
    memory = bottom.twinx()
    memory.plot(t, [s["redis"]["used_memory"] / MB for s in samples], color="tab:red", lw=1, alpha=0.7,
                label="redis used_memory")
    memory.set_ylabel("Redis used_memory (MB)", color="tab:red")
    handles = bottom.get_legend_handles_labels()
    extra = memory.get_legend_handles_labels()
    bottom.legend(handles[0] + extra[0], handles[1] + extra[1], **outside)
    sizes = sorted({k for s in samples for k, v in (s.get("router") or {}).items()
                    if isinstance(v, int) and not isinstance(v, bool) and k not in ROUTER_COUNTERS})
    for key in sizes:
        state.plot(t, [(s.get("router") or {}).get(key, math.nan) for s in samples], lw=1.2, label=key)
    state.set_ylabel("router state (entries)")
    state.set_yscale("symlog", linthresh=10)
    state.set_xlabel("time (s)")
    state.grid(alpha=0.3)
    if sizes:
        state.legend(**outside)
    marks = out["marks"]
    for axis in (top, bottom, state):
        if marks.get("baseline_t") is not None:
            axis.axvline(marks["baseline_t"], color="gray", ls="--", lw=1)
        if marks.get("load_end_t") is not None:
            axis.axvline(marks["load_end_t"], color="gray", ls=":", lw=1)
    if marks.get("baseline_t") is not None:
        top.annotate(f" first {out['setup']['baseline_after']} done", (marks["baseline_t"], 0), xycoords=("data",
                     "axes fraction"), fontsize=7, rotation=90, va="bottom", ha="right")
    if marks.get("load_end_t") is not None:
        top.annotate(" load ends (TTLs run out after)", (marks["load_end_t"], 0), xycoords=("data", "axes fraction"),
                     fontsize=7, rotation=90, va="bottom", ha="right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workflows", type=int, default=10_000, help="workflow instances in all (default 10,000)")
    parser.add_argument("--concurrency", type=int, default=16, help="client threads, each one instance at a time "
                        "(default 16)")
    parser.add_argument("--abandon", type=float, default=0.10, help="share of instances that make one agent call and "
                        "never finish; the state TTL must expire them (default 0.10)")
    parser.add_argument("--unique", type=float, default=0.10, help="share of instances with a template of their own "
                        "(unique name and ~6 KB preamble), never reused; the template idle TTL must drop it "
                        "(default 0.10)")
    parser.add_argument("--reregister", type=float, default=0.02, help="share of instances that first re-register the "
                        "shared template with a changed prompt, while other clients of it are live (default 0.02)")
    parser.add_argument("--preamble-chars", type=int, default=6000, help="unique templates' preamble before every "
                        "agent's prompt (default 6000)")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per agent call (default 4)")
    parser.add_argument("--task-chars", type=int, default=64, help="dynamic task text per agent call (default 64)")
    parser.add_argument("--replicas", type=int, default=2, help="simulated engine replicas (default 2)")
    parser.add_argument("--time-scale", type=float, default=0.02, help="wall seconds per simulated second "
                        "(default 0.02: engine time is 50x faster than the A10G profile's)")
    parser.add_argument("--ttl-s", type=float, default=30.0, help="the app's state_ttl_s (idle clients expire) and "
                        "template_idle_ttl_s (unused templates are dropped), default 30; the run waits this long "
                        "(plus --drain-extra-s) after the load before its final sample")
    parser.add_argument("--template-ttl-s", type=float, default=None, help="template_idle_ttl_s when it should "
                        "differ from --ttl-s (must be >= it)")
    parser.add_argument("--drain-extra-s", type=float, default=5.0, help="wait this much past the TTLs after the "
                        "load (the router purges once a second), default 5")
    parser.add_argument("--sample-s", type=float, default=2.0, help="seconds between samples (default 2)")
    parser.add_argument("--baseline-after", type=int, default=None, help="the RSS baseline is sampled when this many "
                        "instances are done (default 1,000, or 10%% of --workflows when fewer than 10,000)")
    parser.add_argument("--redis", default=None, help="use this Redis (redis://host:port/db; it should be empty) "
                        "instead of starting a redis-server here")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="HTTP timeout per request (default 120)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the instance mix's order (default 0)")
    results_file.add_out_argument(parser, "soak.json and soak.png")
    parser.add_argument("--scale-clients", type=lambda text: [int(n) for n in text.split(",")],
                        default=[1000, 10_000, 50_000], help="after the soak, time finish_client in the router's "
                        "core (no Ray) with this many live clients, comma-separated (default 1000,10000,50000)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workflows < 1 or args.concurrency < 1:
        parser.error("--workflows and --concurrency must be at least 1")
    if not 0 <= args.abandon + args.unique + args.reregister <= 1:
        parser.error("--abandon + --unique + --reregister must be between 0 and 1")
    if args.template_ttl_s is None:
        args.template_ttl_s = args.ttl_s
    if args.template_ttl_s < args.ttl_s:
        parser.error("--template-ttl-s must be >= --ttl-s (the app requires template_idle_ttl_s >= state_ttl_s)")
    if args.baseline_after is None:
        args.baseline_after = 1000 if args.workflows >= 10_000 else max(1, args.workflows // 10)
    args.baseline_after = min(max(1, args.baseline_after), args.workflows)
    return args


def app_config(args: argparse.Namespace, redis_url: str) -> tuple[Any, dict[str, Any]]:
    from kvflow_ray.router.limits import TenantLimits
    from kvflow_ray.serve.config import AppConfig

    limits = TenantLimits(max_live_clients=max(10_000, args.workflows + 1000),
                          max_templates=max(1000, args.workflows + 100),
                          max_inflight_requests=max(64, 4 * args.concurrency),
                          template_writes_per_s=1000.0, template_write_burst=10_000)
    fields: dict[str, Any] = {"engine": "sim", "replicas": args.replicas, "redis": redis_url,
                              "time_scale": args.time_scale, "state_ttl_s": args.ttl_s, "route_headers": True,
                              "limits": limits}
    fields["template_idle_ttl_s"] = args.template_ttl_s
    setup = {k: v for k, v in fields.items() if k not in ("limits", "redis")}
    setup["limits"] = limits.model_dump()
    return AppConfig(**fields), setup


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from tqdm import tqdm

    from kvflow_ray.serve.app import LocalServer

    kinds = plan(args.workflows, args.abandon, args.unique, args.reregister, args.seed)
    wall: dict[str, float] = {}
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.redis:
            redis_url, redis_proc = args.redis, None
        else:
            redis_url, redis_proc = stack.enter_context(local_redis())
        config, setup = app_config(args, redis_url)
        server = stack.enter_context(LocalServer(config, port=free_port(), num_cpus=2))
        wall["startup_s"] = round(time.monotonic() - started, 1)
        load = Load(args, server.url, kinds)
        if not load.register(load.shared):
            raise SystemExit(f"could not register the shared template: {load.failure_examples}")
        sampler = Sampler(args, load, redis_url, watched_processes(redis_proc))
        sampler.sample("start")
        bar = tqdm(total=args.workflows, desc="soak", unit="wf", file=sys.stderr, disable=True if args.no_progress
                   else None)
        load.on_done = lambda: bar.update(1)
        thread = sampler.start()
        load_started = time.monotonic()
        try:
            load.run()
        finally:
            bar.close()
            sampler.stop(thread)
        wall["load_s"] = round(time.monotonic() - load_started, 1)
        if sampler.baseline_index is None:  # the load ended between two samples
            sampler.sample("baseline")
            sampler.baseline_index = len(sampler.samples) - 1
        sampler.sample("load_end")
        sampler.load_end_index = len(sampler.samples) - 1
        drain = max(args.ttl_s, args.template_ttl_s) + args.drain_extra_s
        print(f"load done in {wall['load_s']} s; waiting {drain:g} s for the TTLs to run out", file=sys.stderr)
        drain_until = time.monotonic() + drain
        while time.monotonic() < drain_until:
            time.sleep(min(args.sample_s, max(0.0, drain_until - time.monotonic())))
            sampler.sample("drain")
        sampler.samples[-1]["tag"] = "final"
        wall["drain_s"] = round(drain, 1)
        floor = ray_call_floor()
        samples = sampler.samples
        out: dict[str, Any] = {
            "generated_by": "benchmarks/soak.py " + " ".join(sys.argv[1:]),
            "setup": {**setup, "workflows": args.workflows, "concurrency": args.concurrency,
                      "mix": {"abandon": args.abandon, "unique": args.unique, "reregister": args.reregister},
                      "preamble_chars": args.preamble_chars, "max_tokens": args.max_tokens,
                      "task_chars": args.task_chars, "baseline_after": args.baseline_after,
                      "sample_s": args.sample_s, "cores": os.cpu_count(),
                      "redis": "external" if args.redis else "local redis-server"},
            "marks": {"baseline_t": samples[sampler.baseline_index]["t"],
                      "load_end_t": samples[sampler.load_end_index]["t"]},
        }
        wall["total_s"] = round(time.monotonic() - started, 1)
        out["summary"] = summarise(args, load, sampler, wall)
        out["summary"]["router_cpu"]["ray_actor_call_floor_ms"] = floor
        out["samples"] = samples
    out["summary"]["finish_client"]["core_at_scale"] = core_scale(args.scale_clients)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    results_file.write_json(args.out, "soak", out)
    png = args.out / "soak.png"
    try:
        plot(out, png)
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'kvflow-ray[bench]')", file=sys.stderr)
    print_summary(out["summary"])
    print(f"\nwrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
