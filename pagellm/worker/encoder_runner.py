"""The vision encoder in the step loop: which rows of a step take image embeddings, and the
encoder cache that makes a repeated image cost one encoding.

The worker holds each sequence's images (sent once, with the sequence). A step that computes
any of an image's positions needs that image's embeddings: those not in the cache are encoded
together (one encoder call over all their tiles), cached by digest (least recently used first
out, within a byte budget), and the rows the step's chunk covers are handed to the model. A
chunked prefill may cut an image anywhere: each chunk takes its own slice of the rows.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from pagellm.model.idefics3_vision import Idefics3Vision
from pagellm.multimodal_inputs import ImageFeature, InputEmbeds
from pagellm.step import ScheduledSequence, SchedulerOutput
from pagellm.worker.input_batch import InputBatch

DEFAULT_CACHE_BYTES = 512 * 2**20


class EncoderRunner:
    """Owns the encoder, each held sequence's images, and the encoder cache."""

    def __init__(self, encoder: Idefics3Vision, device: torch.device, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.encoder = encoder
        self.device = device
        self.image_token_id = encoder.spec.image_token_id
        self.features: dict[str, tuple[ImageFeature, ...]] = {}
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_bytes = 0
        self.max_cache_bytes = cache_bytes
        self.images_encoded = 0  # (a count: what the cache saved shows against the images seen)
        self._encoded_since_taken = 0

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Track the step's new, forked and finished sequences (before the step runs)."""
        for new in scheduler_output.new_sequences:
            if new.mm_features:
                self.features[new.seq_id] = new.mm_features
            else:
                self.features.pop(new.seq_id, None)
        for fork in scheduler_output.forked_sequences:
            if fork.parent_id in self.features:
                self.features[fork.seq_id] = self.features[fork.parent_id]
        for item in scheduler_output.scheduled:
            for sample in item.forks:
                if item.seq_id in self.features:
                    self.features[sample.seq_id] = self.features[item.seq_id]
        for seq_id in scheduler_output.finished_seq_ids:
            self.features.pop(seq_id, None)

    def step_embeds(self, scheduled: list[ScheduledSequence], batch: InputBatch, query_start: np.ndarray) -> InputEmbeds | None:
        """The image rows of a step laid out as ``scheduled`` (``query_start``: each one's first
        flat position); None where it computes no image position."""
        wanted: list[tuple[int, int, ImageFeature]] = []  # (step index, row, image)
        for index, item in enumerate(scheduled):
            for feature in self.features.get(item.seq_id, ()):
                if feature.overlaps(item.start_position, item.start_position + item.num_tokens):
                    wanted.append((index, batch.row_of[item.seq_id], feature))
        if not wanted:
            return None
        embeddings = self._embeddings([feature for _, _, feature in wanted])
        indices: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        for index, row, feature in wanted:
            item = scheduled[index]
            start, stop = max(feature.offset, item.start_position), min(feature.end, item.start_position + item.num_tokens)
            is_image = batch.token_ids[row, feature.offset : feature.end] == self.image_token_id
            order = np.cumsum(is_image) - 1  # each image position's row of the image's embeddings
            window = np.arange(start, stop)
            taken = window[is_image[window - feature.offset]]
            indices.append(int(query_start[index]) + taken - item.start_position)
            rows.append(embeddings[feature.digest][torch.from_numpy(order[taken - feature.offset])])
        return InputEmbeds(torch.from_numpy(np.concatenate(indices)).to(self.device), torch.cat(rows))

    def _embeddings(self, features: list[ImageFeature]) -> dict[str, torch.Tensor]:
        """Each image's embeddings [num_embeds, hidden]: from the cache, or encoded (all the
        missing ones in one encoder call)."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, ImageFeature] = {}
        for feature in features:
            cached = self.cache.get(feature.digest)
            if cached is not None:
                self.cache.move_to_end(feature.digest)
                found[feature.digest] = cached
            else:
                missing[feature.digest] = feature
        if missing:
            found.update(self._encode(list(missing.values())))
        return found

    def _encode(self, features: list[ImageFeature]) -> dict[str, torch.Tensor]:
        pixels = torch.cat([f.pixel_values for f in features]).to(self.device)
        masks = None
        if any(f.pixel_mask is not None for f in features):
            masks = torch.cat([f.pixel_mask if f.pixel_mask is not None else torch.ones(f.pixel_values.shape[0], *f.pixel_values.shape[2:], dtype=torch.bool)
                               for f in features]).to(self.device)  # fmt: skip
        out = self.encoder(pixels, masks)
        # (each its own tensor: a view would keep the whole call's output alive in the cache)
        encoded = {f.digest: rows.clone() for f, rows in zip(features, out.split([f.num_embeds for f in features]))}
        self.images_encoded += len(features)
        self._encoded_since_taken += len(features)
        for digest, rows in encoded.items():
            self._keep(digest, rows)
        return encoded

    def take_encoded(self) -> int:
        """Images encoded since the last call (the step's, for the engine's counters)."""
        count, self._encoded_since_taken = self._encoded_since_taken, 0
        return count

    def _keep(self, digest: str, rows: torch.Tensor) -> None:
        """Cache an image's embeddings, dropping the least recently used past the budget."""
        self.cache[digest] = rows
        self.cache_bytes += rows.numel() * rows.element_size()
        while self.cache_bytes > self.max_cache_bytes and self.cache:
            _, dropped = self.cache.popitem(last=False)
            self.cache_bytes -= dropped.numel() * dropped.element_size()
