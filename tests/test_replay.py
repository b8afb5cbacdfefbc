"""The scenario replay's mapping of simulated token ids into a served vocabulary."""

from __future__ import annotations

from kvflow_ray.client.replay import HttpHost


def test_token_ids_keep_shared_prefixes_and_scatter_the_rest() -> None:
    host = HttpHost("http://127.0.0.1:1", {}, time_scale=1.0, vocab=256)
    a, b = list(range(1, 513)), list(range(257, 769))  # consecutive ids 256 apart: equal modulo the vocabulary
    ids_a, ids_b = host._ids(a), host._ids(b)
    assert all(0 <= t < 256 for t in ids_a + ids_b)
    assert host._ids(a) == ids_a  # equal ids stay equal
    assert sum(x == y for x, y in zip(ids_a, ids_b, strict=True)) < 16  # a chance match now and then, no more
    assert len(set(ids_a)) > 200
    host._pool.shutdown()



def test_a_replay_whose_calls_all_fail_still_ends_and_counts_them() -> None:
    """Nothing listens at the URL: every agent call and finish fails. Each failed call is counted and
    its workflow goes on, so the run ends with every instance walked through."""
    import threading

    from kvflow_ray.engines.sim import workload
    from kvflow_ray.router.core import split_workflow_key

    scenario = workload.fleet(tenants=1, apps=1, clients=2, rate=100.0, seed=0)
    tenants = {split_workflow_key(plan.key)[0] for plan in scenario.plans}
    host = HttpHost("http://127.0.0.1:1", dict.fromkeys(tenants, "key"), time_scale=0.001)
    out: list[object] = []
    runner = threading.Thread(target=lambda: out.append(host.run(scenario.plans)), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert out, "the replay never ended"
    result = out[0]
    assert result.calls > 0 and result.prompt_tokens == 0
    assert len([f for f in result.failures if "/v1/completions" in f]) == result.calls
