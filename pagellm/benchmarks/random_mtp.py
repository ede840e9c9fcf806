"""A random multi-token-prediction (MTP) layer for a model folder (``model/mtp.py``): speculative
method "mtp" on a random-weight model of a real shape (``random_model --shape mla-1b --mtp``),
and the tests' tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagellm.benchmarks.random_norms import randomize_norms_and_biases
from pagellm.model import load_arch_config
from pagellm.model.mtp import mtp_style


def mtp_block_config(folder: str | Path):
    """The config of ``folder``'s model cut to one layer of the MTP layer's kind: full attention,
    experts where the model has them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 1
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0
    if getattr(config, "mlp_layer_types", None) is not None:
        config.mlp_layer_types = ["sparse"]
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"]
    return config


def add_random_mtp_layer(folder: str | Path, seed: int = 0, shared_copies: bool = False) -> None:
    """Give the model in ``folder`` (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash, Qwen3.5) a random MTP
    layer named as its family's checkpoints name it, in ``mtp.safetensors``, and the config's
    count of MTP layers 1: its decoder layer from a one-layer model of that kind (norms and
    biases as ``randomize_norms_and_biases`` makes them, a random correction bias), random norms
    and ``fc``; ``shared_copies``: DeepSeek's copies of the model's embedding and head under the
    layer, as released checkpoints store them (pagellm reads the model's own)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    arch = load_arch_config(str(folder))
    style = mtp_style(arch.architecture)
    prefix, block_prefix = style.prefix(arch), style.block_prefix(arch)
    torch.manual_seed(seed + 11)
    block = AutoModelForCausalLM.from_config(mtp_block_config(folder), dtype=torch.float32)
    randomize_norms_and_biases(block)
    generator = torch.Generator().manual_seed(seed + 12)
    tensors = {}
    for name, tensor in block.state_dict().items():
        if name.startswith("model.layers.0."):
            bias = name.endswith("e_score_correction_bias")  # (a buffer HF starts at zeros)
            value = _random_norm(tensor.shape, False, generator) if bias else tensor
            tensors[block_prefix + name.removeprefix("model.layers.0.")] = value
    hidden = arch.hidden_size
    for part, ours in style.parts.items():
        shape = (hidden, 2 * hidden) if ours == "fc" else (hidden,)
        value = 0.15 * torch.randn(shape, generator=generator) if ours == "fc" else None
        tensors[f"{prefix}{part}.weight"] = _random_norm(shape, arch.norm_unit_offset, generator) if value is None else value
    if shared_copies and "shared_head.head" in style.skipped:
        model = {name: t for shard in sorted(folder.glob("*.safetensors")) for name, t in load_file(str(shard)).items()}
        tensors[prefix + "embed_tokens.weight"] = model["model.embed_tokens.weight"]
        tensors[prefix + "shared_head.head.weight"] = model.get("lm_head.weight", model["model.embed_tokens.weight"])
    settings = json.loads((folder / "config.json").read_text())
    dtype = getattr(torch, str(settings.get("torch_dtype") or settings.get("dtype") or "bfloat16"))
    save_file({n: t.to(dtype).contiguous() for n, t in tensors.items()}, str(folder / "mtp.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        listing = json.loads(index_file.read_text())
        listing["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
        index_file.write_text(json.dumps(listing, indent=2))
    settings[style.count_key] = 1
    (folder / "config.json").write_text(json.dumps(settings, indent=2))


def _random_norm(shape: tuple[int, ...] | torch.Size, unit_offset: bool, generator: torch.Generator) -> torch.Tensor:
    """Norm weights (and correction biases) off their initial values: a mis-mapped one shows."""
    values = 0.3 * torch.randn(shape, generator=generator)
    return values if unit_offset else values + 1.0
