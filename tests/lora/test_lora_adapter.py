"""Adapter files checked against the model before anything runs with them: each thing pagellm
cannot apply is refused by name (a pickle file, another model's shapes, a rank above the limit,
DoRA, modules_to_save, embeddings, half a pair), and the low-rank products the forward adds equal
a dense reference on contiguous and gathered rows."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from pagellm.model.layer_spec import layer_specs
from pagellm.model.loader import load_arch_config
from pagellm.model.lora import LoRASlots, LoRAStep
from pagellm.model.lora_adapter import LoRAAdapterError, inspect_adapter, read_adapter

PREFIX = "base_model.model.model.layers"
# The tiny Llama (tests/helpers/tiny_models.py): hidden 64, q 64, k/v 32, MLP 128, 2 layers.


def _write(folder, tensors: dict[str, list[int]], **config) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}, f)
    save_file({k: torch.randn(shape) for k, shape in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
    return str(folder)


def _pair(layer: int, target: str, rank: int, features_in: int, features_out: int, block: str = "self_attn"):
    return {f"{PREFIX}.{layer}.{block}.{target}.lora_A.weight": [rank, features_in],
            f"{PREFIX}.{layer}.{block}.{target}.lora_B.weight": [features_out, rank]}  # fmt: skip


@pytest.fixture(scope="module")
def arch(tiny_llama_path):
    return load_arch_config(tiny_llama_path)


def test_a_good_adapter_reads_with_its_scaling(tmp_path, arch):
    path = _write(tmp_path / "ok", {**_pair(0, "q_proj", 4, 64, 64), **_pair(1, "down_proj", 4, 128, 64, "mlp")})
    info = inspect_adapter(path, arch, max_rank=8)
    assert info.ranks == {(0, "q_proj"): 4, (1, "down_proj"): 4} and info.scaling[(0, "q_proj")] == 2.0
    rs = _write(tmp_path / "rs", _pair(0, "v_proj", 4, 64, 32), use_rslora=True)
    assert inspect_adapter(rs, arch, 8).scaling[(0, "v_proj")] == 4.0  # alpha / sqrt(r)
    adapter = read_adapter(path, arch, 8)
    a, b = adapter.weights[(0, "q_proj")]
    assert a.shape == (4, 64) and b.shape == (64, 4)


@pytest.mark.parametrize("case, match", [
    ("rank", "rank 16 .* above --max-lora-rank 8"),
    ("other_model", r"needs A \[r, 64\] and B \[32, r\]: the adapter was trained for another model"),
    ("layer", "has 2 layers"),
    ("embedding", "applies adapters to the q/k/v/o/gate/up/down"),
    ("half", "without its pair"),
    ("dora", "use_dora=True"),
    ("modules_to_save", "modules_to_save"),
    ("prefix_tuning", "'PREFIX_TUNING' adapter"),
    ("pickle", "pickle file, which pagellm never loads"),
    ("missing", "is not a folder"),
    ("not_json", "is not JSON"),
    ("not_safetensors", "not a readable safetensors file"),
])  # fmt: skip
def test_what_cannot_be_applied_is_refused_by_name(tmp_path, arch, case, match):
    folder = tmp_path / case
    if case == "rank":
        path = _write(folder, _pair(0, "q_proj", 16, 64, 64))
    elif case == "other_model":
        path = _write(folder, _pair(0, "k_proj", 4, 64, 64))
    elif case == "layer":
        path = _write(folder, _pair(5, "q_proj", 4, 64, 64))
    elif case == "embedding":
        path = _write(folder, {"base_model.model.model.embed_tokens.lora_embedding_A": [4, 100]})
    elif case == "half":
        path = _write(folder, {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": [4, 64]})
    elif case == "dora":
        path = _write(folder, _pair(0, "q_proj", 4, 64, 64), use_dora=True)
    elif case == "modules_to_save":
        path = _write(folder, _pair(0, "q_proj", 4, 64, 64), modules_to_save=["lm_head"])
    elif case == "prefix_tuning":
        path = _write(folder, _pair(0, "q_proj", 4, 64, 64), peft_type="PREFIX_TUNING")
    elif case == "pickle":
        path = _write(folder, _pair(0, "q_proj", 4, 64, 64))
        os.rename(os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin"))
    elif case == "missing":
        path = str(folder / "nowhere")
    elif case == "not_json":
        path = _write(folder, _pair(0, "q_proj", 4, 64, 64))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write("{not json")
    else:
        path = _write(folder, _pair(0, "q_proj", 4, 64, 64))
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
            f.write(b"\xff" * 64)
    with pytest.raises(LoRAAdapterError, match=match):
        inspect_adapter(path, arch, max_rank=8)


@pytest.mark.parametrize("path", ["torch", "kernel-f32", "kernel-bf16"])
def test_low_rank_products_equal_a_dense_reference(tmp_path, arch, cpu_plan, path):
    """Two adapters in two slots over 7 rows: a contiguous run (a view) and gathered rows (an
    index); rows of neither unchanged. q/k/v parts land in their own columns of the fused output.
    Through torch, and through pagellm's AVX2 GEMM on packed weights (float32 and bf16 models)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if path == "kernel-bf16" else torch.float32
    kernels = None if path == "torch" else cpu_plan(dtype).kernels
    if path != "torch" and kernels is None:
        pytest.skip("pagellm's CPU kernels are not built here")
    one = _write(tmp_path / "one", {**_pair(0, "q_proj", 4, 64, 64), **_pair(0, "v_proj", 2, 64, 32)}, r=4)
    two = _write(tmp_path / "two", _pair(0, "k_proj", 3, 64, 32), r=3, lora_alpha=6)
    slots = LoRASlots(layer_specs(arch), max_loras=2, max_rank=4, dtype=dtype, device=torch.device("cpu"),
                      kernels=kernels)  # fmt: skip
    adapters = [read_adapter(one, arch, 4), read_adapter(two, arch, 4)]
    for slot, adapter in enumerate(adapters):
        slots.load(slot, slots.prepare(adapter))
    x, base = torch.randn(7, 64).to(dtype), torch.randn(7, 128).to(dtype)  # qkv: q 0..64, k 64..96, v 96..128
    out = base.clone()
    step = LoRAStep(slots, [(0, slice(1, 4)), (1, torch.tensor([0, 5]))])
    step.add_(out, x, 0, "qkv_proj")
    expected = base.clone()
    columns = {"q_proj": slice(0, 64), "k_proj": slice(64, 96), "v_proj": slice(96, 128)}
    for rows, adapter in ((torch.tensor([1, 2, 3]), adapters[0]), (torch.tensor([0, 5]), adapters[1])):
        for (layer, target), (a, b) in adapter.weights.items():
            expected[rows, columns[target]] += (x[rows].float() @ a.T @ b.T).to(dtype)
    # (bf16: the products' inputs and their shrunk rows rounded to bf16, values up to ~100 here)
    tolerance = dict(atol=0.01 * float(expected.abs().max()), rtol=0.02) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, expected, **tolerance)
    assert torch.equal(out[[4, 6]], base[[4, 6]])
    slots.clear(0)
    out = base.clone()
    step.add_(out, x, 0, "qkv_proj")
    assert torch.equal(out[1:4], base[1:4])  # a cleared slot adds nothing


def test_a_gguf_file_must_be_a_lora_adapter(tmp_path, arch, default_model_path_fixture):
    with pytest.raises(LoRAAdapterError, match="not a LoRA adapter"):
        inspect_adapter(default_model_path_fixture, arch, max_rank=8)  # a model, not an adapter
    pickled = tmp_path / "adapter.bin"
    pickled.write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(LoRAAdapterError, match="pickle file, which pagellm never loads"):
        inspect_adapter(str(pickled), arch, max_rank=8)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(LoRAAdapterError, match="not a readable GGUF file"):
        inspect_adapter(str(junk), arch, max_rank=8)
