"""The scheduler's encoder-cache bookkeeping and the image hashes in prefix-cache blocks.

No model: requests carry MultiModalFeatures with placements only, as the scheduler
sees them, and each test drives `schedule()` directly.
"""

from __future__ import annotations

import pytest

from portaserve.framework.engine.block_manager import BlockManager
from portaserve.framework.engine.encoder_cache import EncoderCacheManager
from portaserve.framework.engine.params import SamplingParams
from portaserve.framework.engine.request import Request
from portaserve.framework.engine.scheduler import Scheduler
from portaserve.framework.multimodal.inputs import IMAGE, MultiModalFeature

PAD = 7


def feature(key: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(IMAGE, key, offset, length, b"", (length,))


def request(rid: str, images: list[tuple[str, int, int]], prompt_len: int = 40) -> Request:
    feats = tuple(feature(*spec) for spec in images)
    tokens = [1 + i % 5 for i in range(prompt_len)]
    for f in feats:
        tokens[f.offset : f.end] = [PAD] * f.length
    return Request(rid, tokens, sampling_params=SamplingParams(max_tokens=4), mm_features=feats, max_tokens=4)


def scheduler(budget: int = 64, encoder_budget: int = 32, cache: int = 64, blocks: int = 64) -> Scheduler:
    bm = BlockManager(num_blocks=blocks, block_size=8, enable_caching=True)
    return Scheduler(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128, block_size=8, block_manager=bm,
                     encoder_budget=encoder_budget, encoder_cache_size=cache)


def test_a_chunk_stops_before_an_image_the_step_cannot_encode():
    s = scheduler(encoder_budget=20)
    s.add_request(request("a", [("img1", 4, 16), ("img2", 24, 16)]))
    out = s.schedule()
    # img1 fits this step's encoder budget (20); img2 would exceed it, so the chunk ends at 24
    assert [f.hash for f in out.scheduled_encoder_inputs] == ["img1"]
    assert out.num_scheduled_tokens["a"] == 24
    out = s.schedule()
    assert [f.hash for f in out.scheduled_encoder_inputs] == ["img2"]
    assert out.num_scheduled_tokens["a"] == 16


def test_a_repeated_image_is_encoded_once_and_evicted_only_when_idle():
    s = scheduler(cache=32)
    s.add_request(request("a", [("same", 0, 16)]))
    s.add_request(request("b", [("same", 8, 16)]))
    out = s.schedule()
    assert [f.hash for f in out.scheduled_encoder_inputs] == ["same"]
    assert s.encoder_cache.num_encoded == 1 and s.encoder_cache.num_hits == 1
    # both requests consumed it: it is idle, kept, and evicted when a new image needs room
    s.add_request(request("c", [("other1", 0, 16), ("other2", 20, 16)]))
    out = s.schedule()
    assert [f.hash for f in out.scheduled_encoder_inputs] == ["other1", "other2"]
    assert out.free_encoder_hashes == ("same",)


def test_manager_refuses_what_referenced_entries_leave_no_room_for():
    cache = EncoderCacheManager(32)
    cache.allocate("x", 20, "r1")
    assert not cache.can_allocate(16)
    cache.release("r1", "x")
    assert cache.can_allocate(16) and not cache.can_allocate(16, keep={"x"})


def _block_hashes(bm: BlockManager, req: Request):
    bm.allocate_slots(req, req.num_tokens)
    return list(bm._state(req).hashes)


@pytest.mark.parametrize("salted", [False, True])
def test_block_hashes_include_the_images_they_hold(salted):
    bm = BlockManager(num_blocks=64, block_size=8, enable_caching=True)
    a = request("a", [("cat", 8, 16)], prompt_len=33)
    b = request("b", [("dog", 8, 16)], prompt_len=33)
    if salted:
        a.cache_salt = b.cache_salt = "tenant"
    ha, hb = _block_hashes(bm, a), _block_hashes(bm, b)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert ha[0] == hb[0]  # the block before the image is shared
    assert ha[1] != hb[1] and ha[2] != hb[2] and ha[3] != hb[3]  # the image's blocks and everything after differ
