"""The pooler a model declares: what ``--pooler-config`` leaves unsaid comes from here.

A sentence-transformers folder says how it pools (``modules.json``, then ``1_Pooling/config.json``
and whether a ``Normalize`` module follows); ``config.json`` may say the model is matryoshka
(``is_matryoshka``, ``matryoshka_dimensions``); a GGUF file written by llama.cpp's converter
carries ``{arch}.pooling_type``. Anything else pools by the last token, normalized.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pagellm.model.gguf_loader import open_gguf, read_metadata
from pagellm.model.loader import is_gguf, resolve_model_path
from pagellm.pooler_config import PoolerConfig

logger = logging.getLogger(__name__)

DEFAULT_POOLER = PoolerConfig(pooling_type="LAST", normalize=True, is_matryoshka=False)
# sentence-transformers' 1_Pooling/config.json switch -> our pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
# llama.cpp's LLAMA_POOLING_TYPE values (none, mean, cls, last, rank).
_GGUF_POOLING = {1: "MEAN", 2: "CLS", 3: "LAST"}
_MAX_JSON_BYTES = 1 << 20


def resolve_pooler(model: str | None, overrides: PoolerConfig) -> PoolerConfig:
    """``overrides`` (the flag), then what the model declares, then the default (every field set)."""
    return overrides.or_else(model_pooler_config(resolve_model_path(model))).or_else(DEFAULT_POOLER)


def model_pooler_config(path: str) -> PoolerConfig:
    """What the checkpoint at ``path`` declares (None fields: nothing)."""
    if is_gguf(path):
        reader = open_gguf(path)
        kind = read_metadata(reader, f"{read_metadata(reader, 'general.architecture', '')}.pooling_type", None)
        return PoolerConfig(pooling_type=_GGUF_POOLING.get(int(kind)) if kind is not None else None)
    folder = Path(path)
    config = _json(folder / "config.json")
    dims = config.get("matryoshka_dimensions")
    matryoshka = bool(config.get("is_matryoshka")) or dims is not None or None
    return PoolerConfig(**_sentence_transformers(folder), is_matryoshka=matryoshka,
                        matryoshka_dimensions=tuple(dims) if isinstance(dims, list) and dims else None)  # fmt: skip


def _sentence_transformers(folder: Path) -> dict[str, Any]:
    """pooling_type and normalize from a sentence-transformers folder's modules (none: {})."""
    modules = _json(folder / "modules.json", default=[])
    if not isinstance(modules, list):
        return {}
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in types:
        return {}
    pooling = _json(folder / str(types["Pooling"].get("path", "1_Pooling")) / "config.json")
    chosen = [kind for key, kind in _ST_MODES.items() if pooling.get(key)]
    if len(chosen) != 1:
        logger.warning("sentence-transformers pooling %s is not one of %s: embeddings pool by the last token unless "
                       "--pooler-config says otherwise", sorted(k for k, v in pooling.items() if v is True),
                       ", ".join(_ST_MODES))  # fmt: skip
        return {"normalize": "Normalize" in types}
    return {"pooling_type": chosen[0], "normalize": "Normalize" in types}


def _json(path: Path, default: Any = None) -> Any:
    """A small JSON file of the checkpoint ({} or ``default`` where there is none)."""
    if not path.is_file():
        return {} if default is None else default
    if path.stat().st_size > _MAX_JSON_BYTES:
        raise ValueError(f"{path.name} is larger than {_MAX_JSON_BYTES} bytes")
    return json.loads(path.read_text(encoding="utf-8"))
