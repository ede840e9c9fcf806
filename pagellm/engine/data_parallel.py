"""Data parallelism: N engine replicas (each in its own process) behind one ``EngineClient``,
with a prefix-cache-aware router.

Each replica is a whole engine (its own scheduler, KV cache and weights) in an
:class:`~pagellm.engine.engine_process.EngineProcess`; a step sends the step call to every
replica with work before reading any answer, so the replicas compute at once. Requests are
placed by :class:`PrefixCacheRouter` (the idea of SGLang's cache-aware router): a prompt goes
to the replica that most recently served the longest run of its leading KV blocks, so that the
replica's prefix cache can serve them, unless that replica is busier than the least busy one
by more than a set margin; otherwise (no useful match, or imbalance) to the least busy replica
(among equally busy ones, the one that holds the fewest blocks).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields

from pagellm.config import EngineConfig
from pagellm.core.kv_snapshot import DEFAULT_MAX_REQUESTS, KVSnapshot
from pagellm.engine.engine_process import EngineProcess
from pagellm.engine.protocol import EngineRequest, EngineStats
from pagellm.multimodal_inputs import ImageFeature, block_image_digests
from pagellm.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterOptions:
    """When a prefix match wins over balance.

    ``min_match_ratio``: the fraction of a prompt's full blocks the best replica must hold;
    ``balance_margin``: how many more unfinished requests than the least busy replica it may
    have; ``max_blocks_per_replica``: block hashes remembered per replica (oldest forgotten).
    """

    min_match_ratio: float = 0.5
    balance_margin: int = 8
    max_blocks_per_replica: int = 1 << 16

    def __post_init__(self) -> None:
        if not 0.0 < self.min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in (0, 1], got {self.min_match_ratio}")
        if self.balance_margin < 0 or self.max_blocks_per_replica < 1:
            raise ValueError("balance_margin must be >= 0 and max_blocks_per_replica >= 1")


def block_hashes(token_ids: Sequence[int], block_size: int, images: tuple[ImageFeature, ...] = ()) -> list[int]:
    """One hash per full block of a prompt, each covering every token before it (a prefix) and
    the images with a token in it (their tokens are the same whatever the image)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digests = tuple(block_image_digests(images, start // block_size, block_size)) if images else ()
        previous = hash((previous, tuple(token_ids[start : start + block_size]), digests))
        hashes.append(previous)
    return hashes


class PrefixCacheRouter:
    """Which replica a request goes to (see the module docstring). Approximate: it remembers
    the prefixes it sent to each replica, not what that replica's cache still holds."""

    def __init__(self, num_replicas: int, block_size: int, options: RouterOptions | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.block_size = block_size
        self.options = options or RouterOptions()
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.load = [0] * num_replicas  # unfinished requests per replica
        self.prefix_routed = 0  # requests placed by a prefix match (the rest: by load)

    def route(self, prompt_token_ids: Sequence[int], images: tuple[ImageFeature, ...] = ()) -> int:
        """The replica for a prompt (and its images); it is counted there (``finished`` releases it)."""
        hashes = block_hashes(prompt_token_ids, self.block_size, images)
        # The least busy; among equals, the one holding least (unrelated prompts spread out).
        least = min(range(len(self.load)), key=lambda i: (self.load[i], len(self._seen[i]), i))
        choice = least
        if hashes:
            matched = [self._matched(seen, hashes) for seen in self._seen]
            best = max(range(len(matched)), key=lambda i: (matched[i], -self.load[i]))
            good_match = matched[best] >= self.options.min_match_ratio * len(hashes)
            if good_match and self.load[best] - self.load[least] <= self.options.balance_margin:
                choice = best
                self.prefix_routed += 1
        self._remember(choice, hashes)
        self.load[choice] += 1
        return choice

    def finished(self, replica: int) -> None:
        self.load[replica] = max(0, self.load[replica] - 1)

    @staticmethod
    def _matched(seen: OrderedDict[int, None], hashes: list[int]) -> int:
        count = 0
        for h in hashes:
            if h not in seen:
                break
            count += 1
        return count

    def _remember(self, replica: int, hashes: list[int]) -> None:
        seen = self._seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.options.max_blocks_per_replica:
            seen.popitem(last=False)


def combined_stats(replicas: Sequence[EngineStats]) -> EngineStats:
    """The replicas' counters and gauges summed (KV usage: their mean; peak blocks: the most;
    steps per route: summed per route)."""
    total = EngineStats()
    for field in fields(EngineStats):
        values = [getattr(s, field.name) for s in replicas]
        if field.name == "kv_cache_usage":
            setattr(total, field.name, sum(values) / len(values))
        elif field.name in ("peak_blocks_in_use", "max_loras"):
            setattr(total, field.name, max(values))
        elif field.name in ("step_routes", "lora_running", "lora_waiting"):
            setattr(total, field.name, dict(sum((Counter(v) for v in values), Counter())))
        else:
            setattr(total, field.name, sum(values))
    return total


class DataParallelEngine:
    """The ``EngineClient`` of N engine replicas (see the module docstring). Like every
    ``EngineClient``, called from one thread only."""

    def __init__(self, replicas: list[EngineProcess], router: PrefixCacheRouter) -> None:
        if not replicas:
            raise ValueError("data parallelism needs at least one replica")
        self.replicas = replicas
        self.router = router
        first = replicas[0]
        self.tokenizer = first.tokenizer
        self.input_processor = first.input_processor
        self.max_model_len = first.max_model_len
        self.kernel_plan_info = dict(first.kernel_plan_info, data_parallel_size=str(len(replicas)))
        self._owner: dict[str, int] = {}  # unfinished request id -> its replica

    @classmethod
    def start(cls, configs: list[EngineConfig], options: RouterOptions | None = None, call_timeout_s: float = 600.0) -> DataParallelEngine:
        """One engine process per configuration (started one after another; all closed if one fails)."""
        replicas: list[EngineProcess] = []
        try:
            for config in configs:
                replicas.append(EngineProcess(config, call_timeout_s=call_timeout_s))
        except BaseException:
            for replica in replicas:
                replica.close()
            raise
        return cls(replicas, PrefixCacheRouter(len(replicas), configs[0].cache.block_size, options))

    @property
    def stats(self) -> EngineStats:
        return combined_stats(self.replica_stats)

    @property
    def replica_stats(self) -> list[EngineStats]:
        return [replica.stats for replica in self.replicas]

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    # ---- EngineClient ---------------------------------------------------------------------

    def add_requests(self, requests: list[EngineRequest]) -> list[ValueError | None]:
        placed: dict[int, list[int]] = {}  # replica -> positions in `requests`
        for position, request in enumerate(requests):
            placed.setdefault(self.router.route(request.prompt_token_ids, request.mm_features), []).append(position)
        errors: list[ValueError | None] = [None] * len(requests)
        for replica, positions in placed.items():
            answers = self.replicas[replica].add_requests([requests[p] for p in positions])
            for position, error in zip(positions, answers):
                errors[position] = error
                if error is None:
                    self._owner[requests[position].request_id] = replica
                else:
                    self.router.finished(replica)
        return errors

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        by_replica: dict[int, list[str]] = {}
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if request_id in self._owner:
                by_replica.setdefault(self._owner[request_id], []).append(request_id)
        outputs: list[RequestOutput] = []
        for replica, ids in by_replica.items():
            outputs += self.replicas[replica].abort_request(ids)
            for request_id in ids:
                self._release(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, all computing at once."""
        busy = [replica for replica in self.replicas if replica.has_unfinished_requests()]
        for replica in busy:
            replica.send_step()
        outputs: list[RequestOutput] = []
        for replica in busy:  # every replica is read, even after one fails: none is left mid-call
            try:
                outputs += replica.receive_step()
            except Exception:
                self._drain(replica, busy)
                raise
        for output in outputs:
            if output.finished:
                self._release(output.request_id)
        return outputs

    def snapshot(self, max_requests: int = DEFAULT_MAX_REQUESTS, replica: int = 0) -> KVSnapshot:
        """One replica's snapshot (each has its own pool and queues; the page shows one at a time)."""
        if not 0 <= replica < len(self.replicas):
            raise ValueError(f"replica must be in [0, {len(self.replicas) - 1}], got {replica}")
        return self.replicas[replica].snapshot(max_requests)

    def check_health(self) -> None:
        for replica in self.replicas:
            replica.check_health()

    def restart(self) -> bool:
        """Start every replica anew (their requests are gone: the caller failed them)."""
        for replica in self.replicas:
            replica.restart()
        self._owner.clear()
        self.router = PrefixCacheRouter(len(self.replicas), self.router.block_size, self.router.options)  # caches are empty
        return True

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def _release(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            self.router.finished(replica)

    def _drain(self, failed: EngineProcess, busy: list[EngineProcess]) -> None:
        """Read the other replicas' answers to this step (their outputs are lost with the step)."""
        for replica in busy[busy.index(failed) + 1 :]:
            try:
                replica.receive_step()
            except Exception:  # noqa: BLE001 -- the first failure is the one raised
                logger.exception("engine replica failed too")
