"""BlockManager: reference counts, free pools, chained prefix hashes, LRU eviction."""

from __future__ import annotations

import pytest

from portaserve.framework.engine.block_manager import NULL_BLOCK_ID, BlockManager
from portaserve.framework.engine.params import SamplingParams
from portaserve.framework.engine.request import Request
from portaserve.framework.errors import InvalidParameterError

BS = 4


def req(rid: str, tokens, salt=None, **sp) -> Request:
    return Request(rid, list(tokens), sampling_params=SamplingParams(**sp) if sp else SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, r: Request, num_tokens: int | None = None) -> tuple[list[int], int]:
    """What the scheduler does for a waiting request: look up, allocate, mark computed."""
    hits, num_hit = bm.get_computed_blocks(r)
    n = (r.num_tokens if num_tokens is None else num_tokens) - num_hit
    new = bm.allocate_slots(r, n, hits)
    assert new is not None
    r.num_computed_tokens = num_hit + n
    return hits, num_hit


def check(bm: BlockManager) -> None:
    assert bm.consistency_errors() == []


def test_null_block_reserved_and_capacity():
    bm = BlockManager(5, BS)
    assert bm.num_usable_blocks == 4 and bm.num_free_blocks == 4 and bm.usage == 0.0
    r = req("a", range(16))
    admit(bm, r)
    assert NULL_BLOCK_ID not in bm.block_ids(r)
    assert sorted(bm.block_ids(r)) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    check(bm)
    no_null = BlockManager(4, BS, reserve_null_block=False)
    assert no_null.num_usable_blocks == 4 and no_null.capacity_tokens() == 16
    with pytest.raises(InvalidParameterError, match="num_blocks"):
        BlockManager(1, BS)
    with pytest.raises(InvalidParameterError, match="hash_algo"):
        BlockManager(8, BS, hash_algo="md5")


def test_allocate_grows_one_block_at_a_time_and_fails_cleanly():
    bm = BlockManager(4, BS, enable_caching=False)  # 3 usable
    r = req("a", range(5))
    assert bm.allocate_slots(r, 5) == [1, 2]
    r.num_computed_tokens = 5
    for _ in range(3):  # tokens 6..8 fit in block 2
        assert bm.allocate_slots(r, 1) == []
        r.num_computed_tokens += 1
    assert bm.allocate_slots(r, 1) == [3]
    r.num_computed_tokens += 1
    free_before = bm.num_free_blocks
    assert bm.allocate_slots(r, 4) is None  # would need a 4th block
    assert bm.num_free_blocks == free_before and bm.block_ids(r) == (1, 2, 3)
    check(bm)
    bm.free(r)
    assert bm.num_free_blocks == 3
    check(bm)


def test_same_prefix_hits_and_refcounts():
    bm = BlockManager(16, BS)
    a = req("a", range(10))  # 2 full blocks + 2 tokens
    admit(bm, a)
    b = req("b", list(range(8)) + [99, 98, 97])
    hits, num_hit = admit(bm, b)
    assert num_hit == 8 and hits == list(bm.block_ids(a)[:2])
    for blk in hits:
        assert bm.ref_count(blk) == 2
    assert bm.block_ids(b)[2] != bm.block_ids(a)[2]  # partial blocks are never shared
    check(bm)
    bm.free(a)
    for blk in hits:
        assert bm.ref_count(blk) == 1
    bm.free(b)
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert bm.stats.num_queries == 10 + 11 and bm.stats.num_hits == 8
    check(bm)


def test_different_salt_misses():
    bm = BlockManager(16, BS)
    admit(bm, req("a", range(12), salt="tenant-1"))
    assert bm.get_computed_blocks(req("b", range(12), salt="tenant-2"))[1] == 0
    assert bm.get_computed_blocks(req("c", range(12)))[1] == 0
    assert bm.get_computed_blocks(req("d", range(12), salt="tenant-1"))[1] == 8


def test_different_earlier_block_misses_later_blocks():
    bm = BlockManager(16, BS)
    admit(bm, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block 1's tokens are equal, block 0's differ: the chain makes block 1 miss too.
    assert bm.get_computed_blocks(req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0
    # Equal block 0, different block 1: only block 0 hits.
    assert bm.get_computed_blocks(req("c", [1, 2, 3, 4, 5, 6, 7, 0, 9]))[1] == 4


def test_hit_never_covers_last_token():
    bm = BlockManager(16, BS)
    admit(bm, req("a", range(12)))
    assert bm.get_computed_blocks(req("b", range(8)))[1] == 4  # 2 full blocks, last token recomputed
    assert bm.get_computed_blocks(req("c", range(9)))[1] == 8
    assert bm.get_computed_blocks(req("d", range(4)))[1] == 0
    assert bm.get_computed_blocks(req("e", range(1)))[1] == 0


def test_output_tokens_are_cached_too():
    bm = BlockManager(16, BS)
    a = req("a", range(6))
    admit(bm, a)
    for t in (50, 51, 52):  # decodes: positions 6, 7 fill block 1, then 8
        a.output_token_ids.append(t)
        assert bm.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    b = req("b", [0, 1, 2, 3, 4, 5, 50, 51, 52])
    assert bm.get_computed_blocks(b)[1] == 8


def test_lru_eviction_order():
    bm = BlockManager(7, BS)  # 6 usable
    a = req("a", range(0, 9))  # 3 blocks (2 full + 1 partial)
    b = req("b", range(100, 109))
    admit(bm, a)
    admit(bm, b)
    a_blocks, b_blocks = bm.block_ids(a), bm.block_ids(b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 4
    # Uncached free blocks (the two partial ones) go first, then the least recently
    # freed cached block: a's tail full block, then a's head.
    c = req("c", range(200, 203))
    assert bm.allocate_slots(c, 3) == [a_blocks[2]]
    d = req("d", range(300, 303))
    assert bm.allocate_slots(d, 3) == [b_blocks[2]]
    e = req("e", range(400, 403))
    assert bm.allocate_slots(e, 3) == [a_blocks[1]]
    assert bm.get_computed_blocks(req("a2", range(0, 9)))[1] == 4  # a's head survives
    f = req("f", range(500, 503))
    assert bm.allocate_slots(f, 3) == [a_blocks[0]]
    assert bm.get_computed_blocks(req("a3", range(0, 9)))[1] == 0
    assert bm.get_computed_blocks(req("b2", range(100, 109)))[1] == 8  # b untouched
    check(bm)


def test_hit_on_free_cached_block_takes_it_out_of_the_free_pool():
    bm = BlockManager(4, BS)  # 3 usable
    a = req("a", range(9))
    admit(bm, a)
    bm.free(a)
    b = req("b", list(range(8)) + [7, 7, 7, 7])  # hits 2 blocks, needs 1 more
    hits, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 8
    assert bm.allocate_slots(b, 4, hits) is not None
    assert bm.num_free_blocks == 0
    check(bm)
    # With every block taken, a hit that also needs a new block fails without changes.
    bm.free(b)
    c = req("c", range(20, 24))
    admit(bm, c)  # takes the uncached block; 2 cached-free blocks remain
    d = req("d", list(range(8)) + [1] * 5)  # 2 hits + needs 2 new blocks: only 0 left besides hits
    hits, _ = bm.get_computed_blocks(d)
    assert bm.allocate_slots(d, 5, hits) is None
    assert all(bm.ref_count(blk) == 0 for blk in hits)
    check(bm)


def test_n_siblings_share_the_prompt_blocks():
    bm = BlockManager(32, BS)
    prompt = list(range(18))  # 4 full blocks + 2
    kids = [req(f"p-{i}", prompt) for i in range(4)]
    admit(bm, kids[0])
    for kid in kids[1:]:
        _, num_hit = admit(bm, kid)
        assert num_hit == 16
    shared = bm.block_ids(kids[0])[:4]
    for kid in kids:
        assert bm.block_ids(kid)[:4] == shared
    for blk in shared:
        assert bm.ref_count(blk) == 4
    assert bm.num_free_blocks == 31 - 4 - 4  # 4 shared + one private tail each
    for kid in kids:
        bm.free(kid)
    assert bm.num_free_blocks == 31
    check(bm)


def test_registration_at_allocation_lets_a_same_step_sibling_hit():
    bm = BlockManager(16, BS)
    a, b = req("a", range(10)), req("b", range(10))
    hits, _ = bm.get_computed_blocks(a)
    assert bm.allocate_slots(a, 10, hits) is not None  # not yet computed: the step has not run
    assert bm.get_computed_blocks(b)[1] == 8


def test_free_with_num_computed_uncaches_unwritten_blocks():
    bm = BlockManager(16, BS)
    a = req("a", range(10))
    admit(bm, a, num_tokens=4)  # block 0 computed
    assert bm.allocate_slots(a, 6) is not None  # blocks 1 (full) and 2 allocated this step
    assert bm.is_cached(bm.block_ids(a)[1])
    assert bm.has_shared_uncomputed_blocks(a, 4) is False
    bm.free(a, num_computed_tokens=4)  # dropped from the step: block 1 was never written
    assert bm.get_computed_blocks(req("b", range(10)))[1] == 4
    check(bm)


def test_shared_uncomputed_block_detected():
    bm = BlockManager(16, BS)
    a, b = req("a", range(10)), req("b", range(10))
    bm.allocate_slots(a, 10)
    hits, _ = bm.get_computed_blocks(b)
    bm.allocate_slots(b, 2, hits)
    assert bm.has_shared_uncomputed_blocks(a, 0)


def test_prompt_logprobs_requests_do_not_read_the_cache():
    bm = BlockManager(16, BS)
    admit(bm, req("a", range(10)))
    assert bm.get_computed_blocks(req("b", range(10), prompt_logprobs=1))[1] == 0
    admit(bm, req("c", range(20, 30), prompt_logprobs=0))  # but they fill it
    assert bm.get_computed_blocks(req("d", range(20, 30)))[1] == 8


def test_caching_disabled():
    bm = BlockManager(16, BS, enable_caching=False)
    admit(bm, req("a", range(10)))
    assert bm.get_computed_blocks(req("b", range(10)))[1] == 0
    assert bm.num_cached_free_blocks == 0


def test_reset_prefix_cache():
    bm = BlockManager(16, BS)
    a = req("a", range(10))
    admit(bm, a)
    assert bm.reset_prefix_cache() is False  # a holds blocks
    assert bm.get_computed_blocks(req("b", range(10)))[1] == 8
    bm.free(a)
    assert bm.num_cached_free_blocks == 2
    assert bm.reset_prefix_cache() is True
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 15
    assert bm.get_computed_blocks(req("c", range(10)))[1] == 0
    check(bm)


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_hash_algos_agree_on_hits(algo):
    bm = BlockManager(32, BS, hash_algo=algo)
    admit(bm, req("a", range(20), salt="s"))
    assert bm.get_computed_blocks(req("b", range(20), salt="s"))[1] == 16
    assert bm.get_computed_blocks(req("c", range(20)))[1] == 0
    assert bm.get_computed_blocks(req("d", list(range(19)) + [0], salt="s"))[1] == 16
    assert bm.get_computed_blocks(req("e", [1] + list(range(1, 20)), salt="s"))[1] == 0


def test_duplicate_prefix_computed_twice_keeps_one_cached_copy():
    bm = BlockManager(16, BS)
    a, b = req("a", range(9)), req("b", range(9))
    # Both admitted without looking up (as if hashing raced): both register block 0.
    bm.allocate_slots(a, 9)
    bm.allocate_slots(b, 9)
    a.num_computed_tokens = b.num_computed_tokens = 9
    check(bm)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_free_blocks == 2  # one copy per distinct prefix
    check(bm)
