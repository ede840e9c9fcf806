"""Load the Hugging Face tokenizer that belongs to a model, offline.

Only local paths are ever passed (plus ``local_files_only=True``), so nothing reaches a
hub. For a GGUF model the tokenizer is rebuilt from the file's metadata by transformers;
the chat template comes from the tokenizer, else the GGUF metadata, unless overridden.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pagellm.model.gguf_loader import gguf_chat_template
from pagellm.model.loader import is_gguf, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _read_template(chat_template_path: str) -> str:
    """The override template's text; FileNotFoundError naming the path if absent."""
    path = Path(chat_template_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"chat template file not found: {path}")
    return path.read_text()


def load_tokenizer(model: str | None, chat_template_path: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer (default model for None), with a chat template when one is known."""
    from transformers import AutoTokenizer  # slow import; only pay for it when a tokenizer is needed

    path = resolve_model_path(model)
    if is_gguf(path):
        gguf = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        if not tokenizer.chat_template:
            tokenizer.chat_template = gguf_chat_template(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if chat_template_path is not None:
        tokenizer.chat_template = _read_template(chat_template_path)
    return tokenizer
