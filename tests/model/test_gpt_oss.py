"""gpt-oss beyond its equality with transformers (tests/engine/test_engine_vs_hf.py): its MXFP4
experts dequantized at load as transformers dequantizes them, and what the one-call stack refuses."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.model.mxfp4 import dequantize_mxfp4, join_mxfp4_pairs


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [*shape, 16] and scales ``shape`` of small powers of two (values around 0.1)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 125, shape, generator=generator, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 10, 2), seed=0)  # 3 experts, 10 rows, 64 columns
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(-1, -2), expected)
    joined = dict(join_mxfp4_pairs([("a_scales", scales), ("b", torch.ones(2)), ("a_blocks", blocks)]))
    assert set(joined) == {"a", "b"} and torch.equal(joined["a"], expected)
    with pytest.raises(ValueError, match="without their pair"):
        dict(join_mxfp4_pairs([("a_blocks", blocks)]))
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :1])


@pytest.fixture(scope="module")
def mxfp4_and_dense(tiny_gpt_oss_path: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The tiny gpt-oss with its experts as MXFP4 blocks and scales (as the Hub's checkpoints hold
    them), and the same model with those experts dequantized by transformers."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folders = []
    for kind in ("mxfp4", "dense"):
        folder = tmp_path_factory.mktemp(kind) / "m"
        shutil.copytree(tiny_gpt_oss_path, folder)
        folders.append(folder)
    (shard,) = Path(tiny_gpt_oss_path).glob("*.safetensors")
    tensors = load_file(str(shard))
    packed, dense = dict(tensors), dict(tensors)
    for i, name in enumerate(n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))):
        experts, inputs, outputs = tensors[name].shape
        blocks, scales = _random_mxfp4((experts, outputs, inputs // 32), seed=i)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    for folder, weights in zip(folders, (packed, dense)):
        save_file(weights, str(folder / shard.name), metadata={"format": "pt"})
    config = json.loads((folders[0] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folders[0] / "config.json").write_text(json.dumps(config))
    return str(folders[0]), str(folders[1])


def test_mxfp4_experts_load_as_their_dequantized_values(mxfp4_and_dense: tuple[str, str]) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = ["The sky is", "Once upon a time, in a land far away"]
    outputs = [LLM(path, dtype="float32", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
               for path in mxfp4_and_dense]  # fmt: skip
    for packed, dense in zip(*outputs):
        assert packed.outputs[0].token_ids == dense.outputs[0].token_ids
        assert packed.outputs[0].cumulative_logprob == dense.outputs[0].cumulative_logprob


def test_what_gpt_oss_runs_on(tiny_gpt_oss_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """Its layers run module by module (the one-call stack lacks sinks and MoE) and say why;
    tensor parallelism: tests/distributed/test_tensor_parallel.py."""
    bf16 = LLM(tiny_gpt_oss_path, dtype="bfloat16", num_kv_blocks=64)
    with caplog.at_level(logging.INFO, logger="pagellm.model.fused_stack"):
        assert bf16.llm_engine.executor.model_runner.model._decoder_stack() is None
    assert "module by module" in caplog.text
    assert bf16.generate("Hi", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
