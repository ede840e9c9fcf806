"""Images in the scheduler: a step encodes at most its budget of image rows (a chunk ends before
an image past it; one image always runs), and the prefix cache keys each block by the images in
it (exact keys: equal images share blocks, different ones never do)."""

from __future__ import annotations

import torch

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_cache_utils import hash_block_tokens
from pagellm.core.scheduler import Scheduler
from pagellm.core.sequence import Sequence
from pagellm.multimodal_inputs import ImageFeature
from pagellm.sampling_params import SamplingParams

PIXELS = torch.zeros(1, 3, 2, 2)


def image(digest: str, offset: int, rows: int) -> ImageFeature:
    """An image whose ``rows`` tokens start at ``offset`` (one tile: the scheduler reads no pixels)."""
    return ImageFeature(digest, offset, rows, rows, PIXELS)


def request(seq_id: str, length: int, images: tuple[ImageFeature, ...]) -> Sequence:
    return Sequence(seq_id, list(range(5, 5 + length)), SamplingParams(max_tokens=2), max_tokens=2,
                    mm_features=images)  # fmt: skip


def test_a_step_starts_images_within_its_row_budget() -> None:
    # Token budget 64, image-row budget 64: two 40-row images do not start in one step.
    s = Scheduler(KVCacheManager(64, 4, enable_caching=False), 8, 64, 512)
    s.add_sequence(request("a", 100, (image("x", 2, 40), image("y", 50, 40))))
    step = s.schedule()
    assert [(r.seq_id, r.start_position, r.num_tokens) for r in step.scheduled] == [("a", 0, 50)]  # ends before y
    s.update_from_output(step, _no_samples())
    step = s.schedule()
    assert [(r.start_position, r.num_tokens) for r in step.scheduled] == [(50, 50)]  # y, then the rest


def test_one_image_larger_than_the_budget_still_runs() -> None:
    s = Scheduler(KVCacheManager(64, 4, enable_caching=False), 8, 64, 512)
    s.add_sequence(request("big", 100, (image("x", 10, 80),)))  # 80 rows: more than a step's 64
    step = s.schedule()
    assert [(r.seq_id, r.num_tokens) for r in step.scheduled] == [("big", 64)]
    s.update_from_output(step, _no_samples())
    assert [(r.start_position, r.num_tokens) for r in s.schedule().scheduled] == [(64, 36)]


def test_text_before_an_image_runs_while_the_image_waits() -> None:
    s = Scheduler(KVCacheManager(64, 4, enable_caching=False), 8, 64, 512)
    s.add_sequence(request("a", 60, (image("x", 0, 60),)))
    s.add_sequence(request("b", 40, (image("y", 2, 20),)))  # 4 tokens of budget left, 4 image rows
    step = s.schedule()
    assert [(r.seq_id, r.num_tokens) for r in step.scheduled] == [("a", 60), ("b", 2)]  # b stops before y
    s.update_from_output(step, _no_samples())
    assert [(r.seq_id, r.start_position, r.num_tokens) for r in s.schedule().scheduled] == [("b", 2, 38)]


def test_block_keys_mix_in_the_images_of_each_block() -> None:
    manager = KVCacheManager(16, 4, enable_caching=True)
    first = request("a", 12, (image("x", 5, 2),))  # tokens 5, 6: block 1 only
    manager.update_block_hashes(first)
    tokens = first.all_token_ids
    plain0 = hash_block_tokens(None, tokens[0:4])
    keyed1 = hash_block_tokens(plain0, tokens[4:8], '[null, ["x"]]')
    assert first.block_hashes == [plain0, keyed1, hash_block_tokens(keyed1, tokens[8:12])]
    same = request("b", 12, (image("x", 5, 2),))
    other = request("c", 12, (image("q", 5, 2),))
    manager.update_block_hashes(same)
    manager.update_block_hashes(other)
    assert same.block_hashes == first.block_hashes
    assert other.block_hashes[0] == plain0 and other.block_hashes[1] != keyed1 and other.block_hashes[2] != first.block_hashes[2]


def _no_samples():
    from pagellm.step import ModelRunnerOutput

    return ModelRunnerOutput()
