"""``dtype="auto"``: the checkpoint's precision where the hardware has native bf16, float32 otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagellm import LLM
from pagellm.engine.llm_engine import engine_dtype
from pagellm.model.loader import auto_dtype, checkpoint_is_16bit
from pagellm.worker import device as device_mod


def _with_dtype(src: str, dst: Path, dtype_name: str | None) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if dtype_name is not None:
        config["torch_dtype"] = dtype_name
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_checkpoint_precision_from_config(tiny_llama_path, tmp_path):
    assert checkpoint_is_16bit(_with_dtype(tiny_llama_path, tmp_path / "bf16", "bfloat16"))
    assert checkpoint_is_16bit(_with_dtype(tiny_llama_path, tmp_path / "fp16", "float16"))
    assert not checkpoint_is_16bit(_with_dtype(tiny_llama_path, tmp_path / "fp32", "float32"))
    assert not checkpoint_is_16bit(_with_dtype(tiny_llama_path, tmp_path / "none", None))  # HF default: float32


def test_gguf_counts_as_16bit(default_model_path_fixture):
    assert checkpoint_is_16bit(default_model_path_fixture)


def test_auto_dtype_needs_native_bf16(tiny_llama_path, tmp_path):
    half = _with_dtype(tiny_llama_path, tmp_path / "bf16", "bfloat16")
    full = _with_dtype(tiny_llama_path, tmp_path / "fp32", "float32")
    assert auto_dtype(half, native_bf16=True) is torch.bfloat16
    assert auto_dtype(half, native_bf16=False) is torch.float32
    assert auto_dtype(full, native_bf16=True) is torch.float32
    # An explicit dtype always wins.
    assert engine_dtype("float32", half, torch.device("cpu")) is torch.float32
    assert engine_dtype(torch.bfloat16, full, torch.device("cpu")) is torch.bfloat16


def test_native_bf16_reads_cpu_flags(monkeypatch):
    monkeypatch.setattr(device_mod, "usable_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert device_mod.native_bf16(torch.device("cpu"))
    monkeypatch.setattr(device_mod, "usable_cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert device_mod.native_bf16(torch.device("cpu"))
    monkeypatch.setattr(device_mod, "usable_cpu_flags", lambda: {"avx2", "avx512f"})
    assert not device_mod.native_bf16(torch.device("cpu"))


def test_engine_resolves_auto(tiny_llama_path, tmp_path, monkeypatch):
    assert LLM(tiny_llama_path, num_kv_blocks=8).llm_engine.dtype is torch.float32  # float32 checkpoint
    half = _with_dtype(tiny_llama_path, tmp_path / "bf16", "bfloat16")
    monkeypatch.setattr("pagellm.engine.llm_engine.native_bf16", lambda device: True)
    assert LLM(half, num_kv_blocks=8).llm_engine.dtype is torch.bfloat16
    monkeypatch.setattr("pagellm.engine.llm_engine.native_bf16", lambda device: False)
    assert LLM(half, num_kv_blocks=8).llm_engine.dtype is torch.float32
