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

