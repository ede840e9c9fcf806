"""Random LoRA adapters written by PEFT itself, and PEFT's own greedy decoding over them: the
reference a served adapter must match."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tests.helpers.hf_reference import load_hf_model

MAX_TOKENS = 10  # what the references of tests/lora generate
# 40 and 23 tokens: full 16-token blocks, so that the prefix cache holds some (keyed by adapter).
PROMPTS = [[(7 * i + 3) % 900 + 5 for i in range(40)], [(11 * i + 1) % 700 + 9 for i in range(23)]]
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(
    folder: str, base_path: str, seed: int, targets: Sequence[str] = ALL_TARGETS, rank: int = 8, alpha: int = 16,
    rslora: bool = False, layers: Sequence[int] | None = None,
) -> str:
    """A PEFT LoRA adapter over the model at ``base_path`` with random A and B (not PEFT's zero
    B: the adapter must change the output), saved as PEFT saves one (safetensors)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # (a string: PEFT's regex over the modules' whole names)
    modules = targets if isinstance(targets, str) else list(targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, init_lora_weights=False,
                        use_rslora=rslora, layers_to_transform=list(layers) if layers is not None else None)  # fmt: skip
    model = get_peft_model(load_hf_model(base_path), config)
    with torch.no_grad():  # big enough to move greedy choices on a tiny model
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def peft_model(base_path: str, adapter: str) -> torch.nn.Module:
    """The base model with ``adapter`` applied by PEFT (unmerged: its own forward)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf_model(base_path), adapter).eval()


def write_gguf_lora(peft_folder: str, out: str, num_heads: dict[str, int], arch: str = "llama") -> str:
    """``peft_folder``'s adapter as llama.cpp's ``convert_lora_to_gguf.py`` writes it: its metadata,
    ``blk.N.<tensor>.weight.lora_a`` / ``.lora_b`` (F32), ``B`` of q/k with its rows permuted as
    the converter permutes a Llama's q/k weights (``num_heads``: q_proj's and k_proj's heads)."""
    import json
    import os

    from gguf import GGUFWriter
    from safetensors.torch import load_file

    from pagellm.model.gguf_families import gguf_tensor_name, permute_qk_rows

    with open(os.path.join(peft_folder, "adapter_config.json")) as f:
        config = json.load(f)
    writer = GGUFWriter(out, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key, tensor in sorted(load_file(os.path.join(peft_folder, "adapter_model.safetensors")).items()):
        module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)  # model.layers.N.self_attn.q_proj, A.weight
        target = module.rsplit(".", 1)[1]
        if part.startswith("B") and target in num_heads:
            tensor = permute_qk_rows(tensor, num_heads[target])
        name = f"{gguf_tensor_name(module + '.weight', arch)}.lora_{part[0].lower()}"
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
