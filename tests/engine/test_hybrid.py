"""Hybrid models (LFM2's convolution layers, Granite-4.0-H's Mamba-2 layers, Qwen3.5's gated
delta-nets, beside attention):
their states in slots as few as the running sequences, forked with samples and beams, and what
they cannot do yet refused by name, never answered wrongly."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.model import load_arch_config
from tests.engine.test_engine_vs_hf import MAX_TOKENS, PROMPTS
from tests.engine.test_speculative_decoding import SPEC
from tests.helpers.hf_reference import hf_beam_search, hf_greedy, load_hf_model


@pytest.fixture(scope="module")
def lfm2(tiny_lfm2_path: str) -> LLM:
    """Two state slots (max_num_seqs=2) for five prompts: slots are reused as requests finish."""
    return LLM(tiny_lfm2_path, dtype="float32", block_size=4, max_num_seqs=2)


@pytest.fixture(scope="module", params=["lfm2", "granite_hybrid", "qwen3_5"])
def hybrid(request, lfm2: LLM) -> tuple[LLM, str]:
    """Each hybrid family's engine with two state slots, and its model's path."""
    if request.param == "lfm2":
        return lfm2, request.getfixturevalue("tiny_lfm2_path")
    path = request.getfixturevalue(f"tiny_{request.param}_path")
    return LLM(path, dtype="float32", block_size=4, max_num_seqs=2), path


def test_slots_reused_by_later_requests_start_afresh(hybrid: tuple[LLM, str], default_tokenizer) -> None:
    llm, path = hybrid
    hf = load_hf_model(path)
    expected = [hf_greedy(hf, default_tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round's requests take slots the first round's left dirty
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    engine = llm.llm_engine
    assert engine.scheduler.state_slots is not None and engine.scheduler.state_slots.num_free == 2


def test_samples_start_from_their_parents_state(hybrid: tuple[LLM, str], default_tokenizer) -> None:
    """n = 2, greedy: each sample is born from the prompt's state (copied into its own slot) and
    continues alike; a sample starting from another state would drift from the reference."""
    llm, path = hybrid
    hf = load_hf_model(path)
    prompts = PROMPTS[:3]
    expected = [hf_greedy(hf, default_tokenizer(p).input_ids, MAX_TOKENS) for p in prompts]
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)  # two slots: one request at a time
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected]
    assert llm.llm_engine.scheduler.state_slots.num_free == 2


def test_mamba_states_are_not_kept_per_block_but_in_snapshot_rows_after_the_slots(tiny_granite_hybrid_path: str) -> None:
    """A Mamba-2 state is too big to keep at every block's end: the prefix cache keeps a few in
    rows after the state slots (tests/engine/test_scan_prefix_cache.py); with none, it is off
    (a repeated prompt is computed again, equal)."""
    from pagellm.model.scan_state import ScanState
    from pagellm.worker.kv_cache import state_slot_bytes, state_snapshot_bytes

    arch = load_arch_config(tiny_granite_hybrid_path)
    assert arch.mamba_layers == (0, 1, 3) and not arch.snapshots_states_per_block
    assert state_snapshot_bytes(arch, torch.float32) == 0
    # a slot: 3 layers x (3 convolution inputs of 192 channels + 8 x 16 x 16 float32 state)
    assert state_slot_bytes(arch, 2, torch.float32) == 2 * 3 * (3 * 192 + 8 * 16 * 16) * 4
    llm = LLM(tiny_granite_hybrid_path, dtype="float32", block_size=4, max_num_seqs=2)
    states = [c for c in llm.llm_engine.executor.model_runner.kv_cache if isinstance(c, ScanState)]
    assert [(s.conv.shape[0], s.ssm.shape[0]) for s in states] == [(2 + 4, 2 + 4)] * 3  # (max(4, 2 // 4) rows)
    llm = LLM(tiny_granite_hybrid_path, dtype="float32", block_size=4, max_state_snapshots=0)
    first = tokens(llm, [{"prompt_token_ids": BASE}], GREEDY)
    assert tokens(llm, [{"prompt_token_ids": BASE}], GREEDY) == first
    assert llm.llm_engine.stats.prefix_cache_hits == 0


def test_mamba_layers_refuse_tensor_parallelism_by_name(tiny_granite_hybrid_path: str) -> None:
    words = r"tensor parallelism does not support .*scan \(Mamba-2, gated delta-net\) layers"
    with pytest.raises(ValueError, match=words):
        load_arch_config(tiny_granite_hybrid_path).shard(2)


def test_beam_search_equals_hf(hybrid: tuple[LLM, str], default_tokenizer) -> None:
    """A beam forks with its parent's state copied into a slot its search keeps: the best beam
    equals Hugging Face's beam search (which reorders its recurrent caches by beam). Two slots, a
    search of two beams each: the three searches run one after another."""
    llm, path = hybrid
    hf = load_hf_model(path)
    prompts = PROMPTS[:3]
    outputs = llm.beam_search([{"prompt": p} for p in prompts], BeamSearchParams(beam_width=2, max_tokens=8),
                              use_tqdm=False)  # fmt: skip
    eos = default_tokenizer.eos_token_id
    for prompt, output in zip(prompts, outputs):
        ids = default_tokenizer(prompt).input_ids
        assert output.sequences[0].tokens[len(ids):] == hf_beam_search(hf, ids, 2, 8, 1.0, eos), prompt
    engine = llm.llm_engine
    assert engine.kv_cache_manager.stats.forks > 0 and not engine.beams.groups
    assert engine.scheduler.state_slots.num_free == 2


def test_beam_search_survives_preemption(tiny_granite_hybrid_path: str, default_tokenizer) -> None:
    """A pool too small for three searches of four beams: beams are preempted and computed again
    from their first token into slots their search kept, and the best beams still equal Hugging
    Face's (a fork of a preempted beam: tests/core/test_state_slots.py)."""
    hf = load_hf_model(tiny_granite_hybrid_path)
    small = LLM(tiny_granite_hybrid_path, dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=64,
                max_num_seqs=8)  # fmt: skip
    outputs = small.beam_search([{"prompt": p} for p in PROMPTS[:3]], BeamSearchParams(beam_width=4, max_tokens=12),
                                use_tqdm=False)  # fmt: skip
    assert small.llm_engine.stats.num_preemptions > 0
    eos = default_tokenizer.eos_token_id
    for prompt, output in zip(PROMPTS[:3], outputs):
        ids = default_tokenizer(prompt).input_ids
        assert output.sequences[0].tokens[len(ids):] == hf_beam_search(hf, ids, 4, 12, 1.0, eos), prompt
    assert small.llm_engine.scheduler.state_slots.num_free == 8 and not small.llm_engine.beams.groups


class HalfRightDrafts:
    """A proposer that knows each prompt's greedy answer and drafts its next ``num_right`` tokens
    (2), then wrong ones: every verifying step accepts some drafts and rejects others."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers
        self.num_right = 2

    def propose(self, seq_id: str, tokens: list[int], limit: int) -> list[int]:
        for prompt, answer in self.answers.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                right = answer[done : done + self.num_right]
                return (right + [(t + 1) % 1000 for t in answer[done + len(right) : done + limit]])[:limit]
        raise AssertionError(f"no answer for {seq_id}")

    def remove(self, seq_ids) -> None:
        pass


@pytest.mark.parametrize("family", ["lfm2", "granite_hybrid", "qwen3_5"])
def test_speculation_rolls_the_state_back_to_before_rejected_drafts(request, family: str, default_tokenizer) -> None:
    """Each verifying step keeps the state from before its drafts in a checkpoint row; where some
    are rejected the state goes back to it and the accepted tokens are computed again. Greedy
    output equals Hugging Face's, with drafts accepted and rejected at every step, two state slots
    for three prompts."""
    path = request.getfixturevalue(f"tiny_{family}_path")
    hf = load_hf_model(path)
    prompts = [default_tokenizer(p).input_ids for p in PROMPTS[:3]]
    expected = [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompts]
    llm = LLM(path, dtype="float32", block_size=4, max_num_seqs=2, speculative_config=SPEC)
    speculator = llm.llm_engine.scheduler.speculator
    assert speculator.rolls_back  # (the adaptive choice counts the second step a rejection costs)
    speculator.proposer = HalfRightDrafts({tuple(ids): answer for ids, answer in zip(prompts, expected)})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = speculator.stats
    # Each prompt: its first token, then 6 rounds of 4 (a step accepting 2 drafts of 4 and sampling
    # 1, then a step computing those 3 again and sampling the 4th).
    assert stats.num_drafts == 3 * 6 and stats.num_accepted_tokens == 2 * stats.num_drafts
    assert llm.llm_engine.scheduler.state_slots.num_free == 2


@pytest.mark.parametrize("family", ["granite_hybrid", "qwen3_5"])
def test_speculating_in_bf16_is_plain_decoding_bit_for_bit(request, family: str, default_tokenizer) -> None:
    """In bf16, where a chunked scan or SDPA's blocked sums would round otherwise than the decode
    path, a verification's tokens run as the decode tokens they stand for (token by token through
    the scan, on the attention kernel: head_dim 16 sends prefills to SDPA): with every draft right,
    each step verifying 3, the output is plain decoding's over 64 tokens."""
    path = request.getfixturevalue(f"tiny_{family}_path")
    prompts = [default_tokenizer(p).input_ids for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = LLM(path, dtype="bfloat16", block_size=4, max_num_seqs=2)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": i} for i in prompts], params,
                                                                use_tqdm=False)]  # fmt: skip
    llm = LLM(path, dtype="bfloat16", block_size=4, max_num_seqs=2, speculative_config={**SPEC, "num_speculative_tokens": 3})
    right = HalfRightDrafts({tuple(ids): answer for ids, answer in zip(prompts, expected)})
    right.num_right = 3
    llm.llm_engine.scheduler.speculator.proposer = right
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.llm_engine.scheduler.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 3 * 40


def test_a_draft_model_drafts_for_a_hybrid_target(tiny_qwen3_5_path: str, tiny_llama_path: str,
                                                  default_tokenizer) -> None:  # fmt: skip
    """An attention-only draft model for a hybrid target (a random pair: its drafts rejected, the
    target's state rolled back at each verifying step): greedy output equals Hugging Face's. A
    draft model with recurrent layers is refused by name."""
    prompts = [default_tokenizer(p).input_ids for p in PROMPTS[:3]]
    hf = load_hf_model(tiny_qwen3_5_path)
    spec = {"method": "draft_model", "model": tiny_llama_path, "num_speculative_tokens": 3,
            "disable_by_batch_size": None, "adaptive": False}  # fmt: skip
    llm = LLM(tiny_qwen3_5_path, dtype="float32", block_size=4, max_num_seqs=2, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, ids, 16) for ids in prompts]
    assert llm.llm_engine.scheduler.speculator.stats.num_draft_tokens > 0
    with pytest.raises(ValueError, match="the draft model Qwen3_5ForCausalLM has recurrent layers"):
        LLM(tiny_llama_path, dtype="float32", speculative_config={**spec, "model": tiny_qwen3_5_path})


def test_a_tensor_parallel_rank_holds_its_share_of_the_channels(tiny_lfm2_path: str) -> None:
    """(Two ranks equal to one process: tests/distributed/test_tensor_parallel.py.)"""
    arch = load_arch_config(tiny_lfm2_path)
    assert (arch.convolution_channels, arch.shard(2).convolution_channels) == (64, 32)


@pytest.fixture(scope="module")
def uncached(tiny_lfm2_path: str) -> LLM:
    """The reference: the same engine without the prefix cache (equal to transformers above)."""
    return LLM(tiny_lfm2_path, dtype="float32", block_size=4, max_num_seqs=2, enable_prefix_caching=False)


BASE = list(range(1000, 1013))  # 13 tokens: three full blocks of 4
SHARED = {"prompt_token_ids": BASE[:12] + [5000, 5001, 5002]}  # A's three blocks, then its own
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm: LLM, prompts: list, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_prefix_cached_in_the_same_step_is_not_read_before_its_state_is_written(
    tiny_lfm2_path: str, uncached: LLM
) -> None:
    """A and a prompt sharing its first blocks admitted together: those blocks are registered
    when the step computing them is scheduled, but their states exist only after its forward."""
    llm = LLM(tiny_lfm2_path, dtype="float32", block_size=4, max_num_seqs=2)
    first = {"prompt_token_ids": BASE}
    expected = [tokens(uncached, [p], GREEDY)[0] for p in (first, SHARED)]
    assert tokens(llm, [first, SHARED], GREEDY) == expected
    assert tokens(llm, [SHARED], GREEDY) == expected[1:]  # now from the cache (blocks computed)
    assert llm.llm_engine.stats.prefix_cache_hits > 0


def test_a_slot_given_again_takes_its_load_after_the_copy_queued_into_it(
    tiny_lfm2_path: str, uncached: LLM
) -> None:
    """A (n = 2, one token) ends with a copy into its sample's slot still queued; the next step
    gives that slot to a request loading a cached block's state: the load must win."""
    llm = LLM(tiny_lfm2_path, dtype="float32", block_size=4, max_num_seqs=2)
    other = {"prompt_token_ids": list(range(3000, 3010))}
    one = SamplingParams(n=2, temperature=0, max_tokens=1, ignore_eos=True)
    expected = [tokens(uncached, [p], GREEDY)[0] for p in (other, SHARED)]
    outputs = llm.generate([{"prompt_token_ids": BASE}, other, SHARED], [one, GREEDY, GREEDY], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[1:]] == expected


def test_a_hybrid_draft_model_is_refused_by_name(tiny_llama_path: str, tiny_lfm2_path: str) -> None:
    config = {"method": "draft_model", "model": tiny_lfm2_path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="draft model Lfm2ForCausalLM has recurrent"):
        LLM(tiny_llama_path, dtype="float32", speculative_config=config)


def test_adapters_on_qwen3_5_take_the_mlp_and_its_gated_q_proj(tiny_qwen3_5_path: str, tmp_path) -> None:
    """An MLP adapter on a hybrid equals PEFT's; so does one on Qwen3.5's q_proj (each head's query
    and output gate in one projection: its B split as the weight is) and v_proj."""
    from pagellm.lora_request import LoRARequest
    from tests.helpers.lora_adapters import peft_model, write_lora_adapter

    mlp = write_lora_adapter(str(tmp_path / "mlp"), tiny_qwen3_5_path, seed=3,
                             targets=("gate_proj", "up_proj", "down_proj"))  # fmt: skip
    prompts = [{"prompt_token_ids": BASE}]
    expected = [hf_greedy(peft_model(tiny_qwen3_5_path, mlp), BASE, 8)]
    assert expected != [hf_greedy(load_hf_model(tiny_qwen3_5_path), BASE, 8)]
    llm = LLM(tiny_qwen3_5_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    assert tokens(llm, prompts, GREEDY) != expected  # (without the adapter)
    outputs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("mlp", 1, mlp), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    q = write_lora_adapter(str(tmp_path / "q"), tiny_qwen3_5_path, seed=4, targets=("q_proj", "v_proj"))
    expected = [hf_greedy(peft_model(tiny_qwen3_5_path, q), BASE, 8)]
    outputs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("q", 2, q), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
