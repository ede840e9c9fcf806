"""What keys the disk tier's entries: everything that decides a block's K/V besides its tokens.

An engine's entries live in a folder named by this key under ``--kv-offload-dir``
(``disk_tier_files``): an engine of another model, dtype, kernel plan, KV-cache dtype, block size,
layout, pagellm or torch never reads them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import IO

import torch

from pagellm import disk_tier_files
from pagellm.config import EngineConfig
from pagellm.disk_tier_files import TierLayout
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.loader import resolve_model_path
from pagellm.model.weights_fingerprint import weights_fingerprint

FORMAT = 1  # of the entries (``disk_tier_files``) and of the key's parts


def tier_layout(
    config: EngineConfig, arch: ModelArchConfig, plan_info: dict[str, str], kv_cache_dtype: torch.dtype,
    payload_bytes: int, device: torch.device,
) -> tuple[TierLayout, IO[bytes]]:
    """This engine's folder under ``--kv-offload-dir`` (created, and held while the returned file
    is open), keyed by the weights (``weights_fingerprint``), the model's shape, the kernel plan
    (dtype, GEMMs, the CPU: other kernels round otherwise), the device, the KV dtype, the block
    size, the ranks, and the code that computes K/V (pagellm's sources, torch's version).
    ValueError naming what the tier does not run with."""
    if arch.recurrent_layers:
        raise ValueError(f"kv_offload_dir: {arch.architecture} has recurrent layers, whose states a disk tier does "
                         "not keep yet")  # fmt: skip
    if arch.window_of_every_layer is not None:
        raise ValueError(f"kv_offload_dir: every layer of {arch.architecture} has a sliding window, which releases "
                         "blocks a disk tier would keep; not supported yet")  # fmt: skip
    assert config.cache.kv_offload_dir is not None
    parts = {
        "format": FORMAT, "code": code_fingerprint(), "torch": torch.__version__, "device": device_name(device),
        "weights": weights_fingerprint(resolve_model_path(config.model.model)), "arch": repr(arch),
        "quantization": config.model.quantization, "plan": plan_info, "kv_cache_dtype": str(kv_cache_dtype),
        "block_size": config.cache.block_size, "payload_bytes": payload_bytes,  # (an MTP layer's K/V in it or not)
        "world": [config.device.tensor_parallel_size, config.device.pipeline_parallel_size],
    }  # fmt: skip
    key = disk_tier_files.tier_key(parts)
    folder = disk_tier_files.open_tier_folder(config.cache.kv_offload_dir, key)
    lock = disk_tier_files.lock_folder(folder)
    return TierLayout(str(folder), key, payload_bytes), lock


def device_name(device: torch.device) -> str:
    """The device's kind and, for an accelerator, its model (its kernels round their own way)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}:{torch.version.cuda}"
    return device.type


_SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def code_fingerprint() -> str:
    """A digest of pagellm's sources (Python and C++): an update starts a new folder (the old one's
    room is taken back once no engine holds it: ``disk_tier_files.make_room``)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]
