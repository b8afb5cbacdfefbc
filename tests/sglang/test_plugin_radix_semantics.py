"""SGLang's radix-cache contract still holds on a cache that runs the plugin: insert / match / split
/ evict / lock semantics, in the style of SGLang's own mem_cache unit tests (unittest.TestCase,
subTest over trees and page sizes), on caches built with `--radix-eviction-policy kvflow`."""

from __future__ import annotations

import unittest
from collections.abc import Callable

import pytest
import sglang_caches as sc

from kvflow_ray.engines.sglang.state import reset_state

CASES = [(tree, page) for tree in sc.TREES for page in (1, 4)]


@pytest.mark.usefixtures("sglang_plugin")
class TestRadixSemanticsWithPlugin(unittest.TestCase):
    def setUp(self) -> None:
        reset_state()

    def each_cache(self, check: Callable[[sc.CacheRig, int], None]) -> None:
        for tree, page in CASES:
            with self.subTest(tree=tree, page_size=page):
                check(sc.build(tree, "kvflow", kv_tokens=512, page_size=page), page)

    @staticmethod
    def size(rig: sc.CacheRig) -> int:
        return rig.evictable() + rig.protected()

    def test_insert_reports_the_prefix_already_cached(self) -> None:
        def check(rig: sc.CacheRig, page: int) -> None:
            first = rig.insert(list(range(1, 17)))
            self.assertEqual(first.prefix_len, 0)
            second = rig.insert(list(range(1, 9)) + list(range(100, 108)))
            self.assertEqual(second.prefix_len, 8)
            self.assertEqual(self.size(rig), 24)

        self.each_cache(check)

    def test_match_returns_the_longest_page_aligned_prefix(self) -> None:
        def check(rig: sc.CacheRig, page: int) -> None:
            rig.insert(list(range(1, 17)))
            self.assertEqual(rig.matched(list(range(1, 17))), 16)
            self.assertEqual(rig.matched([*list(range(1, 11)), 99, 98]), 10 // page * page)
            self.assertEqual(rig.matched([99, *list(range(1, 16))]), 0)

        self.each_cache(check)

    def test_match_splits_the_node_it_ends_in(self) -> None:
        def check(rig: sc.CacheRig, page: int) -> None:
            rig.insert(list(range(1, 17)))
            match = rig.match(list(range(1, 9)))
            node = rig.node(match.last_device_node)
            self.assertEqual(len(node.key), 8)
            self.assertEqual(len(list(node.children.values())), 1)

        self.each_cache(check)

    def test_evict_frees_slots_back_to_the_allocator(self) -> None:
        def check(rig: sc.CacheRig, page: int) -> None:
            free_before = rig.allocator.available_size()
            rig.insert(list(range(1, 33)))
            self.assertEqual(rig.allocator.available_size(), free_before - 32)
            self.assertEqual(rig.evictable(), 32)
            self.assertGreaterEqual(rig.evict(32), 32)
            self.assertEqual(rig.evictable(), 0)
            self.assertEqual(rig.allocator.available_size(), free_before)
            self.assertEqual(rig.matched(list(range(1, 33))), 0)

        self.each_cache(check)

    def test_lock_protects_the_path_from_eviction(self) -> None:
        def check(rig: sc.CacheRig, page: int) -> None:
            rig.insert(list(range(1, 17)))
            rig.insert(list(range(1, 9)) + list(range(200, 208)))
            handle = rig.match(list(range(1, 17))).last_device_node
            locked = rig.lock(handle)
            self.assertEqual(rig.protected(), 16)
            self.assertEqual(rig.evictable(), 8)
            rig.evict(100)
            self.assertEqual(rig.matched(list(range(1, 17))), 16)
            self.assertEqual(rig.matched(list(range(1, 9)) + list(range(200, 208))), 8)
            rig.unlock(handle, locked)
            self.assertEqual(rig.protected(), 0)
            self.assertEqual(rig.evictable(), 16)
            rig.evict(100)
            self.assertEqual(rig.matched(list(range(1, 17))), 0)

        self.each_cache(check)

    def test_requests_through_checkpoint_share_their_common_prefix(self) -> None:
        def check(rig: sc.CacheRig, page: int) -> None:
            rig.serve(list(range(1, 41)), "c1", "a", fixed=32)
            rig.serve(list(range(1, 33)) + list(range(500, 508)), "c1", "b", fixed=32)
            self.assertEqual(self.size(rig), 48)
            self.assertEqual(rig.matched(list(range(1, 41))), 40)
            self.assertEqual(rig.protected(), 0, "finished requests leave no lock behind")

        self.each_cache(check)
