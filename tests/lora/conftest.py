"""Shared adapters over the session's tiny Llama, written by PEFT (module scope: each takes a
fraction of a second, and the references are computed once)."""

from __future__ import annotations

import pytest

from pagellm import LoRARequest
from tests.helpers.hf_reference import hf_greedy, load_hf_model
from tests.helpers.lora_adapters import MAX_TOKENS, PROMPTS, peft_model, write_lora_adapter


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three adapters of the tiny Llama: every projection at rank 8; q and v at rank 4 with
    rsLoRA; the MLP of layer 0 alone at rank 2."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": write_lora_adapter(str(root / "all"), tiny_llama_path, seed=1),
        "qv": write_lora_adapter(str(root / "qv"), tiny_llama_path, seed=2, targets=("q_proj", "v_proj"), rank=4,
                                 rslora=True),
        "mlp0": write_lora_adapter(str(root / "mlp0"), tiny_llama_path, seed=3,
                                   targets=("gate_proj", "up_proj", "down_proj"), rank=2, layers=[0]),
    }  # fmt: skip


@pytest.fixture(scope="session")
def references(tiny_llama_path: str, lora_adapters: dict[str, str]) -> dict[str | None, list[list[int]]]:
    """Each prompt's greedy tokens under the base model (None) and under each adapter, by PEFT."""
    models = {None: load_hf_model(tiny_llama_path)}
    models.update({name: peft_model(tiny_llama_path, path) for name, path in lora_adapters.items()})
    refs = {name: [hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS] for name, model in models.items()}
    assert len({tuple(map(tuple, r)) for r in refs.values()}) == len(refs), "every adapter must change the output"
    return refs


@pytest.fixture(scope="session")
def requests(lora_adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(lora_adapters.items()))}
