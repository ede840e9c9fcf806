"""Load the Hugging Face tokenizer that belongs to a model, offline.

Only local paths are ever passed (plus ``local_files_only=True``), so nothing reaches a
hub. For a GGUF model the tokenizer is rebuilt from the file's metadata by transformers;
the chat template comes from the tokenizer, else the GGUF metadata, unless overridden.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pagellm.model.gguf_loader import gguf_chat_template
from pagellm.model.loader import is_gguf, resolve_model_path
from pagellm.utils import cache_root, owned_by_me, private_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def tokenizer_cache_dir() -> Path | None:
    """Where tokenizers rebuilt from GGUF files are kept (None: caching disabled).

    ``PAGELLM_CACHE_DIR`` (else ``$XDG_CACHE_HOME/pagellm``, else ``~/.cache/pagellm``) +
    ``/tokenizers``; ``PAGELLM_TOKENIZER_CACHE=0`` turns the cache off.
    """
    if os.environ.get("PAGELLM_TOKENIZER_CACHE", "1").lower() in ("0", "false", "no", "off"):
        return None
    return cache_root() / "tokenizers"


def _cache_key(gguf: Path) -> str:
    """Changes whenever the file or the libraries that build the tokenizer change."""
    import tokenizers
    import transformers

    stat = gguf.stat()
    ident = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{tokenizers.__version__}|1"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


# Tokenizer classes a cached folder names that load without ``AutoTokenizer``: importing that
# imports ``transformers.models``, whose import scans all of its ~570 model files (0.6 s of every
# start-up; a GGUF tokenizer is most often of this plain class).
_PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """A Hugging Face tokenizer folder's tokenizer. One of the plain class (``tokenizer.json``
    alone: Llama 3's, and the GGUF cache's) loads through that class: ``AutoTokenizer`` would
    first import ``transformers.models``, whose ``__init__`` scans ~570 model files (0.6-2 s)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent or unreadable: AutoTokenizer decides, and names the problem
        config = None
    if isinstance(config, dict) and config.get("tokenizer_class") in _PLAIN_TOKENIZER_CLASSES:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _load_cached(folder: Path | None) -> PreTrainedTokenizerBase | None:
    if folder is None or not (folder / "tokenizer_config.json").is_file() or not owned_by_me(folder):
        return None
    try:
        return _folder_tokenizer(folder)
    except Exception as exc:  # a damaged or foreign cache entry: rebuild from the GGUF file
        logger.warning("ignoring cached tokenizer in %s: %s", folder, exc)
        return None


def _store_cached(tokenizer: PreTrainedTokenizerBase, folder: Path | None) -> None:
    """Save atomically (temp folder + rename); a read-only or full disk only costs the speed-up."""
    if folder is None:
        return
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, folder)
        tmp = None
    except OSError as exc:
        logger.debug("could not cache the tokenizer in %s: %s", folder, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


_GGUF_ARCHITECTURES_LOCK = threading.Lock()


@contextlib.contextmanager
def _gguf_architecture_known(path: str) -> Iterator[None]:
    """transformers reads a GGUF file's tokenizer only for the architectures whose weights it
    loads, though the tokenizer depends only on the file's ``tokenizer.ggml.*`` keys: a family it
    lacks (SmolLM3, Granite, OLMo 2) is listed for the time of the read."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from pagellm.model.gguf_loader import open_gguf, read_metadata

    known = gguf_utils.GGUF_SUPPORTED_ARCHITECTURES
    architecture = str(read_metadata(open_gguf(path), "general.architecture", ""))
    with _GGUF_ARCHITECTURES_LOCK:  # (one reader at a time changes transformers' list)
        added = bool(architecture) and architecture not in known
        if added:
            known.append(architecture)
        try:
            yield
        finally:
            if added:
                known.remove(architecture)


# GGUF architectures transformers has no config class for (it picks a GGUF file's tokenizer class
# through one): the class is named by the file's tokenizer model instead.
_ARCHITECTURES_WITHOUT_CONFIG = {"granitehybrid"}
_TOKENIZER_TYPES = {"gpt2": "gpt2", "llama": "llama"}  # tokenizer.ggml.model -> transformers' tokenizer type


def _tokenizer_type(path: str) -> dict[str, str]:
    """``tokenizer_type`` for the GGUF file's tokenizer where its architecture needs one (none else)."""
    from pagellm.model.gguf_loader import open_gguf, read_metadata

    reader = open_gguf(path)
    if str(read_metadata(reader, "general.architecture", "")) not in _ARCHITECTURES_WITHOUT_CONFIG:
        return {}
    model = str(read_metadata(reader, "tokenizer.ggml.model", ""))
    if model not in _TOKENIZER_TYPES:
        raise ValueError(f"the GGUF file's tokenizer model {model!r} is not supported here "
                         f"(only {sorted(_TOKENIZER_TYPES)})")  # fmt: skip
    return {"tokenizer_type": _TOKENIZER_TYPES[model]}


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer transformers rebuilds from GGUF metadata (seconds: it re-parses the whole
    vocabulary), cached on disk after the first build and loaded from there (~0.1 s) after."""
    gguf = Path(path)
    root = tokenizer_cache_dir()
    if root is not None and not private_dir(root):
        logger.warning("the tokenizer cache %s is not private to this user; not using it", root)
        root = None
    folder = root / _cache_key(gguf) if root is not None else None
    tokenizer = _load_cached(folder)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    with _gguf_architecture_known(path):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True,
                                                  **_tokenizer_type(path))  # fmt: skip
    if not tokenizer.chat_template:
        tokenizer.chat_template = gguf_chat_template(path)
    _store_cached(tokenizer, folder)
    return tokenizer


# Templates shipped with pagellm, selected by name (--chat-template NAME) instead of a path.
BUILTIN_CHAT_TEMPLATES = ("chatml-tools",)


def read_chat_template(chat_template_path: str) -> str:
    """The override template's text (a file, or a built-in template's name); FileNotFoundError
    naming the path if absent."""
    if chat_template_path in BUILTIN_CHAT_TEMPLATES:
        return (Path(__file__).parent / "chat_templates" / f"{chat_template_path}.jinja").read_text()
    path = Path(chat_template_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"chat template file not found: {path}")
    return path.read_text()


def load_tokenizer(model: str | None, chat_template_path: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer (default model for None), with a chat template when one is known."""
    path = resolve_model_path(model)
    if is_gguf(path):
        tokenizer = _gguf_tokenizer(path)
        if not tokenizer.chat_template:
            tokenizer.chat_template = gguf_chat_template(path)
    else:
        tokenizer = _folder_tokenizer(Path(path))
    if chat_template_path is not None:
        tokenizer.chat_template = read_chat_template(chat_template_path)
    return tokenizer
