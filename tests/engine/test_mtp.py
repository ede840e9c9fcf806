"""Speculative decoding from the model's own multi-token-prediction (MTP) layer (speculative
method "mtp"; tiny DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash with a random MTP layer): every draft is the
layer's as transformers computes it over the sequence's tokens (through accepted, partly
accepted and rejected verifications), greedy output equals plain decoding through chunked
prefill, prefix-cache hits, preemption and the disk tier, and configurations without the layer
are refused by name."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import pagellm.worker.model_runner as model_runner_module
from pagellm import LLM, SamplingParams
from pagellm.benchmarks.random_mtp import mtp_block_config
from pagellm.config import DeviceConfig, EngineConfig, ModelConfig
from pagellm.model import load_arch_config
from pagellm.model.mtp import mtp_style
from pagellm.speculative_config import SpeculativeConfig

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False, "disable_by_batch_size": None}
PROMPTS = [{"prompt_token_ids": list(range(300 + 7 * i, 300 + 7 * i + length))} for i, length in enumerate((9, 37, 70))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def all_blocks_free(llm: LLM) -> bool:
    engine = llm.llm_engine
    return engine.kv_cache_manager.num_free_blocks == engine.executor.num_blocks


class MtpReference:
    """The MTP layer as transformers computes it: the target's final hidden states from its HF
    model, the layer's decoder block as a one-layer model of the same kind whose final norm is
    the layer's last norm and whose head is the model's."""

    def __init__(self, folder: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tensors = {name: t for shard in Path(folder).glob("*.safetensors") for name, t in load_file(str(shard)).items()}
        arch = load_arch_config(folder)
        style = mtp_style(arch.architecture)
        prefix, block = style.prefix(arch), style.block_prefix(arch)
        self.own = {ours: tensors[f"{prefix}{part}.weight"] for part, ours in style.parts.items()}
        state = {"model.layers.0." + name.removeprefix(block): t for name, t in tensors.items()
                 if name.startswith(block) and name.removeprefix(prefix).rpartition(".")[0] not in
                 (*style.parts, *style.skipped)}  # fmt: skip
        state["model.norm.weight"] = self.own["out_norm"]
        state["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        state["lm_head.weight"] = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        self.layer = AutoModelForCausalLM.from_config(mtp_block_config(folder), dtype=torch.float32).eval()
        self.layer.load_state_dict(state, strict=True)
        self.eps, self.unit_offset, self.normed = arch.rms_norm_eps, arch.norm_unit_offset, style.normed_output
        self._out: list[torch.Tensor] = []
        self.layer.model.layers[0].register_forward_hook(lambda _m, _i, out: self._out.append(out))

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + weight if self.unit_offset else weight)

    def _joined(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        both = torch.cat([self._rms(embeds, self.own["embed_norm"]), self._rms(hidden, self.own["hidden_norm"])], dim=-1)
        return both @ self.own["fc"].T

    @torch.no_grad()
    def drafts(self, known: list[int], k: int) -> list[int]:
        """The k greedy drafts after ``known``: the layer at each position p from h_p and the
        token at p + 1, then from its own last output (before or after its last norm, as the
        family runs it) and the draft before."""
        ids = torch.tensor(known)
        hidden = self.target.model(ids[None]).last_hidden_state[0]
        embed = self.target.model.embed_tokens
        inputs = self._joined(embed(ids[1:]), hidden[:-1])
        drafts: list[int] = []
        for _ in range(k):
            self._out.clear()
            normed = self.layer.model(inputs_embeds=inputs[None], use_cache=False).last_hidden_state[0]
            drafts.append(int(self.layer.lm_head(normed[-1]).argmax()))
            chain = normed[-1:] if self.normed else self._out[0][0, -1:]
            inputs = torch.cat([inputs, self._joined(embed(torch.tensor(drafts[-1:])), chain)])
        return drafts


def record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the sequence's tokens, its drafts) of every proposal the engine's drafter makes."""
    drafter = llm.llm_engine.executor.model_runner.drafter
    records: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recorded(batch, scheduled, output):  # type: ignore[no-untyped-def]
        filled, masks = propose(batch, scheduled, output)
        for item in filled:
            if item.draft_token_ids:
                row = batch.row_of[item.seq_id]
                records.append((batch.token_ids[row, : batch.num_tokens[row]].tolist(), list(item.draft_token_ids)))
        return filled, masks

    drafter.propose = recorded
    return records


@pytest.mark.parametrize("family", ["tiny_deepseek_v3_mtp_path", "tiny_glm4_moe_mtp_path", "tiny_glm4_moe_lite_mtp_path",
                                    "tiny_qwen3_5_mtp_path", "tiny_qwen3_5_moe_mtp_path"])
def test_every_draft_is_the_mtp_layers_over_the_sequence(family, request, monkeypatch):
    """Verification forced to keep 0, 1, 2, 3 drafts in turn (the engine's bookkeeping of the
    layer's K/V and last outputs through every outcome), prompts in chunks of a 16-token budget:
    each proposal equals the reference's over the tokens the sequence held then."""
    folder = request.getfixturevalue(family)
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=16, speculative_config=MTP)
    records = record_drafts(llm)
    counter = itertools.count()
    monkeypatch.setattr(model_runner_module, "accepted_prefix", lambda _tokens, drafts: next(counter) % (len(drafts) + 1))
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(records) > 15 and {len(drafts) for _, drafts in records} >= {3}
    reference = MtpReference(folder)
    for known, drafts in records:
        assert drafts == reference.drafts(known, len(drafts)), len(known)
    assert all_blocks_free(llm)


@pytest.fixture(scope="module")
def plain(tiny_deepseek_v3_mtp_path):
    return LLM(tiny_deepseek_v3_mtp_path, dtype="float32", block_size=4)


def test_greedy_output_is_plain_decodings(tiny_deepseek_v3_mtp_path, plain, tmp_path):
    """Chunked prompts, a shared prefix (hits), a pool small enough to preempt, and a disk tier
    the prefix comes back from: plain decoding's tokens, every block freed."""
    shared = {"prompt_token_ids": list(range(500, 540))}
    prompts = [*PROMPTS, shared, {"prompt_token_ids": shared["prompt_token_ids"] + [7, 8, 9]}]
    want = tokens(plain, prompts, GREEDY)
    small = LLM(tiny_deepseek_v3_mtp_path, dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16,
                speculative_config=MTP)  # fmt: skip
    assert tokens(small, prompts, GREEDY) == want
    engine = small.llm_engine
    assert engine.stats.num_preemptions > 0 and engine.kv_cache_manager.stats.hits > 0
    assert engine.scheduler.speculator.stats.num_draft_tokens > 40
    assert all_blocks_free(small)
    # Steps of more than 2 sequences draft nothing and skip the layer: the last two then draft
    # over the rows those steps left unwritten.
    busy = LLM(tiny_deepseek_v3_mtp_path, dtype="float32", block_size=4, speculative_config={**MTP, "disable_by_batch_size": 2})
    model, runs = busy.llm_engine.executor.model_runner.drafter.source.model, []
    layer = model.mtp_hidden
    model.mtp_hidden = lambda *args: runs.append(len(args[4].query_lens)) or layer(*args)  # (sequences a run)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # (three end early: the batch shrinks)
    assert tokens(busy, prompts, [short, short, short, GREEDY, GREEDY]) == [w[:4] for w in want[:3]] + want[3:]
    assert busy.llm_engine.scheduler.speculator.stats.num_draft_tokens > 0 and runs and max(runs) <= 2
    tier = LLM(tiny_deepseek_v3_mtp_path, dtype="float32", block_size=4, num_kv_blocks=26, speculative_config=MTP,
               kv_offload_dir=str(tmp_path))  # fmt: skip
    assert tokens(tier, [shared], GREEDY) == want[3:4]
    assert tokens(tier, PROMPTS[1:], GREEDY) == want[1:3]  # (pushes the shared prefix out of the pool)
    before = tier.llm_engine.stats.disk_tier_loaded_blocks
    assert tokens(tier, [shared], GREEDY) == want[3:4]
    assert tier.llm_engine.stats.disk_tier_loaded_blocks - before >= 9


def test_a_hybrids_greedy_output_is_plain_decodings(tiny_qwen3_5_mtp_path):
    """Qwen3.5 (gated delta-nets: each rejection rolls their states back): plain decoding's tokens."""
    want = tokens(LLM(tiny_qwen3_5_mtp_path, dtype="float32", block_size=4), PROMPTS, GREEDY)
    spec = LLM(tiny_qwen3_5_mtp_path, dtype="float32", block_size=4, max_num_batched_tokens=16, speculative_config=MTP)
    assert tokens(spec, PROMPTS, GREEDY) == want
    assert spec.llm_engine.scheduler.speculator.stats.num_draft_tokens > 20
    assert all_blocks_free(spec)


def test_constrained_requests_take_mtp_drafts_within_their_grammar(plain, tiny_deepseek_v3_mtp_path):
    """Each draft masked by the request's grammar (a regex that leaves few choices: most drafts
    are the grammar's and accepted), each verified under the grammar's state: plain decoding's
    text."""
    from pagellm.structured_outputs_params import StructuredOutputsParams

    spec = LLM(tiny_deepseek_v3_mtp_path, dtype="float32", block_size=4, speculative_config=MTP)
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex="(one two three four ){3}one two"))  # fmt: skip
    prompts = ["Count:", "Say it again"]
    got = [o.outputs[0].text for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].text for o in plain.generate(prompts, params, use_tqdm=False)]
    assert all(text.startswith("one two three four one two") for text in got)
    stats = spec.llm_engine.scheduler.speculator.stats
    assert stats.num_draft_tokens > 10 and stats.num_accepted_tokens > 0


def test_sampled_requests_repeat_themselves(tiny_deepseek_v3_mtp_path):
    spec = LLM(tiny_deepseek_v3_mtp_path, dtype="float32", speculative_config=MTP)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)
    first = spec.generate(PROMPTS, sampled, use_tqdm=False)
    again = spec.generate(PROMPTS, sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert all(len(o.outputs[0].logprobs) == 24 for o in first)


def test_every_block_holds_the_mtp_layer_too(tiny_deepseek_v3_mtp_path):
    """The layer's latent rows are a fourth layer's in every block: a budget of 64 blocks of the
    model's 3 layers and the MTP layer's buys 64 blocks (85 without it)."""
    per_layer = 4 * 40 * 4  # (a block of 4 tokens, one latent row of 40 float32 values)
    llm = LLM(tiny_deepseek_v3_mtp_path, dtype="float32", block_size=4, kv_cache_memory=64 * 4 * per_layer,
              speculative_config=MTP)  # fmt: skip
    executor = llm.llm_engine.executor
    assert executor.num_blocks == 64
    ((key_cache, value_cache),) = executor.model_runner.drafter.kv_cache
    assert key_cache is value_cache and tuple(key_cache.shape) == (64, 4, 1, 40)


def test_mtp_configurations_refused_by_name(tiny_llama_path, tiny_deepseek_v3_path):
    with pytest.raises(ValueError, match="multi-token prediction layers; LlamaForCausalLM has none"):
        LLM(tiny_llama_path, speculative_config={"method": "mtp"})
    # (its config declares one layer, its checkpoint holds a stray placeholder)
    with pytest.raises(ValueError, match="weight|missing"):
        LLM(tiny_deepseek_v3_path, speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="belong to method 'draft_model', not 'mtp'"):
        SpeculativeConfig.parse({"method": "mtp", "model": "x"})
    assert SpeculativeConfig.parse({"method": "deepseek_mtp"}).method == "mtp"
    with pytest.raises(ValueError, match="'mtp' runs in a one-process engine"):
        EngineConfig(model=ModelConfig(model=tiny_llama_path), device=DeviceConfig(tensor_parallel_size=2),
                     speculative=SpeculativeConfig(method="mtp"))  # fmt: skip


def test_the_layers_names_and_count_by_family():
    """DeepSeek's layer past the model's and Qwen3.5's ``mtp.`` land under one module; the
    copies of the model's tensors and further layers are not loaded; the count is the text
    model's (Qwen3.5's vision-language wrapper's ``text_config``)."""
    from types import SimpleNamespace

    from pagellm.model.mtp import mtp_layer_count, mtp_name
    from pagellm.model.text_of_multimodal import text_model_config

    deepseek = SimpleNamespace(architecture="DeepseekV3ForCausalLM", num_hidden_layers=61)
    assert mtp_name("model.layers.61.enorm.weight", deepseek) == "mtp_layer.embed_norm.weight"
    assert mtp_name("model.layers.61.shared_head.norm.weight", deepseek) == "mtp_layer.out_norm.weight"
    assert mtp_name("model.layers.61.mlp.experts.3.up_proj.weight", deepseek) == "mtp_layer.block.mlp.experts.3.up_proj.weight"
    assert mtp_name("model.layers.61.shared_head.head.weight", deepseek) is None
    assert mtp_name("model.layers.61.embed_tokens.weight", deepseek) is None
    assert mtp_name("model.layers.60.mlp.gate.weight", deepseek) == "model.layers.60.mlp.gate.weight"
    qwen = SimpleNamespace(architecture="Qwen3_5ForCausalLM", num_hidden_layers=24)
    assert mtp_name("mtp.pre_fc_norm_hidden.weight", qwen) == "mtp_layer.hidden_norm.weight"
    assert mtp_name("mtp.norm.weight", qwen) == "mtp_layer.out_norm.weight"
    assert mtp_name("mtp.layers.0.self_attn.q_proj.weight", qwen) == "mtp_layer.block.self_attn.q_proj.weight"
    assert mtp_name("mtp.layers.1.self_attn.q_proj.weight", qwen) is None
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"mtp_num_hidden_layers": 1}}
    assert mtp_layer_count("Qwen3_5ForCausalLM", text_model_config(wrapper)) == 1
    assert mtp_layer_count("DeepseekV3ForCausalLM", {"num_nextn_predict_layers": 1}) == 1
    for bad in ({}, {"num_nextn_predict_layers": 0}, {"num_nextn_predict_layers": True}, {"num_nextn_predict_layers": "1"}):
        with pytest.raises(ValueError, match="num_nextn_predict_layers"):
            mtp_layer_count("DeepseekV3ForCausalLM", bad)
