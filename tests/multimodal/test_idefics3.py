"""Idefics3 (SmolVLM): images in, text out, equal to ``transformers`` on a tiny random
checkpoint; the encoder cache and the prefix cache keyed by image; bad image input refused
with the engine still serving."""

from __future__ import annotations

import io

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.helpers.tiny_vlm import png_header_only, random_image, write_tiny_idefics3

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    return write_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3"), default_tokenizer)


@pytest.fixture(scope="module")
def hf_vlm(vlm_path: str):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(vlm_path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(vlm_path)


@pytest.fixture(scope="module")
def vlm(vlm_path: str) -> LLM:
    # 64-token steps: a prompt's images are cut across prefill chunks.
    return LLM(vlm_path, dtype="float32", max_num_batched_tokens=64, limit_mm_per_prompt={"image": 3})


def hf_greedy(hf_vlm, prompt: str, images: list, max_tokens: int = 8) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy output ids) of the reference."""
    model, processor = hf_vlm
    inputs = processor(text=prompt, images=[images] if images else None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids) :].tolist()


CASES = {
    "one image, split into tiles": ("User: what is in <image>?\nAssistant:", [(70, 45)]),
    "a small image: one tile and the whole": ("Describe <image> please", [(20, 20)]),
    "two images mixed with text": ("First <image> then <image> compared:", [(64, 96), (33, 17)]),
    "an image first, text after": ("<image>What colour?", [(40, 90)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(vlm: LLM, hf_vlm, case: str) -> None:
    prompt, sizes = CASES[case]
    images = [random_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    prompt_ids, expected = hf_greedy(hf_vlm, prompt, images)
    out = vlm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == prompt_ids
    assert out.outputs[0].token_ids == expected


def test_a_batch_of_prompts_with_different_images(vlm: LLM, hf_vlm) -> None:
    """Several prompts in one step, each with its own image (one of them text only)."""
    prompts = [("Look: <image>", [random_image(50, 30, 11)]), ("Look: <image>", [random_image(30, 50, 12)]),
               ("No image here at all", [])]  # fmt: skip
    expected = [hf_greedy(hf_vlm, text, images)[1] for text, images in prompts]
    outs = vlm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts], GREEDY,
                        use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_repeated_image_is_encoded_once_and_its_blocks_are_cached(vlm: LLM, hf_vlm) -> None:
    runner = vlm.llm_engine.executor.model_runner.encoder
    image = random_image(61, 47, 21)
    prompt = {"prompt": "Repeat after me <image> and stop", "multi_modal_data": {"image": [image]}}
    stats = vlm.llm_engine.stats
    images_before = stats.num_images
    first = vlm.generate(prompt, GREEDY, use_tqdm=False)[0]
    encoded = runner.images_encoded
    assert stats.num_images_encoded == encoded  # (the engine's counter: the worker's, step by step)
    second = vlm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert stats.num_images == images_before + 2 and stats.num_images_encoded == encoded
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens >= len(first.prompt_token_ids) - 16  # all but the last (partial) block
    assert runner.images_encoded == encoded  # served from the prefix cache: not encoded again
    # The same text with another image: its blocks are not the first image's.
    other = {"prompt": prompt["prompt"], "multi_modal_data": {"image": [random_image(61, 47, 22)]}}
    third = vlm.generate(other, GREEDY, use_tqdm=False)[0]
    first_image_block = (first.prompt_token_ids.index(vlm.llm_engine.input_processor.images.spec.image_token_id)) // 16
    assert third.num_cached_tokens <= first_image_block * 16
    assert third.outputs[0].token_ids == hf_greedy(hf_vlm, other["prompt"], other["multi_modal_data"]["image"])[1]
    assert runner.images_encoded == encoded + 1


def test_the_encoder_cache_reuses_an_image_the_prefix_cache_lost(vlm_path: str, hf_vlm) -> None:
    """Without prefix caching the prompt is computed again, but its image is not encoded again."""
    llm = LLM(vlm_path, dtype="float32", enable_prefix_caching=False)
    runner = llm.llm_engine.executor.model_runner.encoder
    prompt = {"prompt": "<image><image> twice", "multi_modal_data": {"image": [random_image(30, 30, 5)] * 2}}
    outs = [llm.generate(prompt, GREEDY, use_tqdm=False)[0] for _ in range(2)]
    assert runner.images_encoded == 1
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == hf_greedy(
        hf_vlm, prompt["prompt"], prompt["multi_modal_data"]["image"])[1]  # fmt: skip


def _undecodable():
    from PIL import Image

    data = io.BytesIO()
    random_image(40, 40, 3).save(data, format="PNG")
    return Image.open(io.BytesIO(data.getvalue()[:80]))  # a header, then the file ends


def _huge():
    from PIL import Image

    return Image.open(io.BytesIO(png_header_only(9_000, 9_000)))


BAD = {
    "more placeholders than images": ("<image> and <image>", lambda: [random_image(8, 8, 0)], "2 <image> placeholders for 1"),
    "an image without a placeholder": ("no placeholder", lambda: [random_image(8, 8, 0)], "0 <image> placeholders for 1"),
    "too many images": ("<image>" * 4, lambda: [random_image(8, 8, i) for i in range(4)], "4 images, more than the limit of 3"),
    "not an image": ("<image>", lambda: ["a string"], "image 0 is a str, not a PIL image"),
    "9,000 x 9,000 pixels": ("<image>", lambda: [_huge()], "9000 x 9000 pixels: more than the limit"),
    "an undecodable file": ("<image>", lambda: [_undecodable()], "image 0 could not be read"),
    "another modality": ("<image>", None, "pagellm takes images only"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_input_is_refused_and_the_engine_serves_on(vlm: LLM, hf_vlm, case: str) -> None:
    text, images, message = BAD[case]
    data = {"audio": [b""]} if images is None else {"image": images()}
    with pytest.raises(ValueError, match=message):
        vlm.generate({"prompt": text, "multi_modal_data": data}, GREEDY, use_tqdm=False)
    assert not vlm.llm_engine.has_unfinished_requests()
    image = random_image(24, 24, 9)
    out = vlm.generate({"prompt": "ok <image>", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_vlm, "ok <image>", [image])[1]


def test_image_tokens_without_an_image_are_refused(vlm: LLM) -> None:
    with pytest.raises(ValueError, match="image tokens but no image"):
        vlm.generate("a text that spells <image> itself", GREEDY, use_tqdm=False)


def test_a_text_model_takes_no_images(tiny_llama_path: str) -> None:
    llm = LLM(tiny_llama_path, dtype="float32")
    with pytest.raises(ValueError, match="this model takes no images"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": random_image(8, 8, 0)}}, GREEDY, use_tqdm=False)


def test_the_vision_encoder_equals_transformers(vlm: LLM, hf_vlm) -> None:
    """Tiles with padding (a pixel mask) included: the reference's image features, row for row."""
    model, processor = hf_vlm
    encoder = vlm.llm_engine.executor.model_runner.encoder.encoder
    images = [random_image(70, 20, 31), random_image(10, 33, 32)]
    inputs = processor(text="<image><image>", images=[images], return_tensors="pt")
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output[0]
    mask = inputs["pixel_attention_mask"][0].bool()
    got = encoder(inputs["pixel_values"][0], mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# SmolVLM's own chat template: it loops over each message's content parts.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_a_template_that_loops_over_parts_gets_parts(vlm: LLM) -> None:
    """Image parts reach a parts-looping template as ``{"type": "image"}`` (it writes their
    placeholder), a plain template as the placeholder in the joined text."""
    from types import SimpleNamespace

    from pagellm.entrypoints.openai.protocol import ChatMessageParam
    from pagellm.entrypoints.openai.serving_chat import Conversation, render_conversation

    serving = SimpleNamespace(engine=SimpleNamespace(input_processor=vlm.llm_engine.input_processor))
    url = {"url": "data:image/png;base64,AAAA"}
    messages = [ChatMessageParam.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": url}, {"type": "text", "text": "What is it?"}]})]  # fmt: skip
    looped = render_conversation(serving, Conversation(messages, template_kwargs={"chat_template": SMOLVLM_TEMPLATE}))
    assert looped == "<|im_start|>User:<image>What is it?<end_of_utterance>\nAssistant:"
    joined = render_conversation(serving, Conversation(messages))
    assert "<image>\nWhat is it?" in joined and joined.count("<image>") == 1


def test_llm_chat_takes_image_parts_as_vllms(vlm: LLM, hf_vlm) -> None:
    """``LLM.chat`` with ``image_pil`` and ``image_url`` (data: URL) parts: the conversation
    rendered (each image its placeholder in the joined text), then as a prompt with images."""
    import base64

    first, second = random_image(40, 30, 41), random_image(20, 50, 42)
    out = io.BytesIO()
    second.save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image_pil", "image_pil": first},
                                             {"type": "image_url", "image_url": {"url": url}}]}]  # fmt: skip
    got = vlm.chat(messages, GREEDY, use_tqdm=False)[0]
    model, processor = hf_vlm
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "Compare\n<image>\n<image>"}],
                                                   tokenize=False, add_generation_prompt=True)  # fmt: skip
    inputs = processor(text=text, images=[[first, second]], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(got.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert got.outputs[0].token_ids == expected


def test_text_content_reaches_a_parts_template_as_a_text_part(vlm: LLM) -> None:
    """SmolVLM's template loops over content parts: a message's plain text content goes to it as
    one text part (as ``transformers``' processors give it), never as characters to loop over."""
    processor = vlm.llm_engine.input_processor
    text = processor.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                                 chat_template=SMOLVLM_TEMPLATE)  # fmt: skip
    assert text == "<|im_start|>System: Be brief.<end_of_utterance>\nUser: Hello<end_of_utterance>\nAssistant:"


def test_image_features_cross_a_process_by_value() -> None:
    """The engine process's pipe pickles features whole: no shared-memory file per tensor."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 -- (registers torch's shared-memory reducers, as a pipe's sender has)

    from pagellm.multimodal_inputs import ImageFeature

    assert b"rebuild_storage" in bytes(ForkingPickler.dumps(torch.randn(2)))  # (what a bare tensor would do)
    for dtype in (torch.float32, torch.bfloat16):  # (a bf16 model keeps its pixels in bf16)
        feature = ImageFeature("d", 3, 20, 16, torch.randn(2, 3, 4, 4).to(dtype), torch.ones(2, 4, 4, dtype=torch.bool))
        data = bytes(ForkingPickler.dumps(feature))
        assert b"rebuild_storage" not in data
        back = pickle.loads(data)
        assert (back.digest, back.offset, back.length, back.num_embeds) == ("d", 3, 20, 16)
        assert back.pixel_values.dtype == dtype and torch.equal(back.pixel_values, feature.pixel_values)
        assert torch.equal(back.pixel_mask, feature.pixel_mask)


def test_the_bf16_encoder_on_pagellms_kernels_stays_near_the_reference(vlm_path: str, hf_vlm) -> None:
    """bf16 with the fused bias and GELU kernel (what a bf16 engine runs): each image row within
    bf16's rounding of the float32 reference's."""
    from pagellm import kernels
    from pagellm.config import KernelConfig
    from pagellm.model.loader import load_vision_encoder

    library = kernels.load(KernelConfig())
    encoder = load_vision_encoder(vlm_path, torch.bfloat16, torch.device("cpu"), library)
    assert encoder.vision_model.encoder.layers[0].mlp.kernels is library
    model, processor = hf_vlm
    inputs = processor(text="<image>", images=[[random_image(70, 45, 51)]], return_tensors="pt")
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output[0]
    got = encoder(inputs["pixel_values"][0], inputs["pixel_attention_mask"][0].bool()).float()
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosine.min() > 0.999, cosine.min()


def test_images_cross_the_step_codec_whole_and_bad_bytes_are_refused() -> None:
    """New sequences' images travel to other ranks and nodes in the pickle-free step codec: their
    pixels and masks come back bit for bit; truncated or trailing bytes, or an unknown dtype,
    are a CodecError."""
    import json

    from pagellm.multimodal_inputs import ImageFeature
    from pagellm.step import NewSequence, ScheduledSequence, SchedulerOutput
    from pagellm.step_codec import CodecError, decode_step, encode_step

    images = (ImageFeature("a" * 64, 3, 40, 32, torch.randn(2, 3, 8, 8), torch.rand(2, 8, 8) > 0.5),
              ImageFeature("b" * 64, 50, 16, 16, torch.randn(1, 3, 8, 8)))  # fmt: skip
    step = SchedulerOutput([ScheduledSequence("s", 0, 66, True)],
                           [NewSequence("s", list(range(70)), 70, GREEDY, mm_features=images)])  # fmt: skip
    data = encode_step(step, None)
    back, _ = decode_step(data)
    for got, sent in zip(back.new_sequences[0].mm_features, images, strict=True):
        assert (got.digest, got.offset, got.length, got.num_embeds) == (sent.digest, sent.offset, sent.length, sent.num_embeds)
        assert torch.equal(got.pixel_values, sent.pixel_values)
        assert (got.pixel_mask is None) == (sent.pixel_mask is None)
        assert got.pixel_mask is None or torch.equal(got.pixel_mask, sent.pixel_mask)
    size = int.from_bytes(data[:4], "little")
    def with_header(change) -> bytes:
        edited = json.loads(data[4 : 4 + size])
        change(edited)
        text = json.dumps(edited).encode()
        return len(text).to_bytes(4, "little") + text + data[4 + size :]

    unknown_dtype = with_header(lambda h: h["blobs"][0].update(dtype="object"))
    mask_is_pixels = with_header(lambda h: h["new"][0]["images"][0].update(mask=0))
    past_the_end = with_header(lambda h: h["new"][0]["images"][1].update(pixels=9))
    for bad in (data[:-1], data + b"\x00", unknown_dtype, mask_is_pixels, past_the_end):
        with pytest.raises(CodecError):
            decode_step(bad)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
def test_images_under_tensor_and_pipeline_parallelism_give_one_process_s_tokens(vlm_path: str, vlm: LLM, layout: dict) -> None:
    prompts = [{"prompt": "Look: <image> and <image>", "multi_modal_data": {"image": [random_image(50, 30, 61), random_image(30, 50, 62)]}},
               {"prompt": "Only text"}]  # fmt: skip
    expected = [o.outputs[0].token_ids for o in vlm.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(vlm_path, dtype="float32", max_num_batched_tokens=64, **layout)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    finally:
        llm.llm_engine.close()


def test_a_bf16_engine_keeps_its_pixels_in_bf16_and_answers_as_the_bf16_reference(vlm_path: str) -> None:
    """The encoder casts its pixels to the model's dtype first (as the reference does), so a bf16
    engine keeps them in bf16 from the start: half the memory, the same tokens."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    llm = LLM(vlm_path, dtype="bfloat16")
    prompt, images = "Look: <image>", [random_image(50, 30, 71)]
    processed = llm.llm_engine.input_processor.process_prompt({"prompt": prompt, "multi_modal_data": {"image": images}})
    assert processed.mm_features[0].pixel_values.dtype == torch.bfloat16
    model = Idefics3ForConditionalGeneration.from_pretrained(vlm_path, dtype=torch.bfloat16).eval()
    inputs = AutoProcessor.from_pretrained(vlm_path)(text=prompt, images=[images], return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1].float()
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, SamplingParams(temperature=0, max_tokens=1,
                       logprobs=2), use_tqdm=False)[0].outputs[0]  # fmt: skip
    top2 = logits.topk(2)
    if float(top2.values[0] - top2.values[1]) > 0.1:  # (bf16 kernels round apart: equal where the top two are apart)
        assert out.token_ids[0] == int(top2.indices[0])
    assert out.token_ids[0] in top2.indices.tolist()


def test_the_image_limits_refuse_values_out_of_range() -> None:
    """--limit-mm-per-prompt (JSON or vLLM's offline dict) and --max-image-pixels: wrong types,
    unknown modalities, negative or huge-and-wrong values are a ValueError naming the option."""
    from pagellm.config import LimitsConfig
    from pagellm.engine_args import images_per_prompt

    assert images_per_prompt(None) == 8 and images_per_prompt('{"image": 0}') == 0
    assert images_per_prompt({"image": 3}) == 3
    for bad, message in [("{not json", "not JSON"), ('["image"]', "must be an object"), ('{"video": 1}', "must be an object"),
                         ('{"image": -1}', "non-negative integer"), ('{"image": 1.5}', "non-negative integer"),
                         ('{"image": true}', "non-negative integer"), ('{"image": "8"}', "non-negative integer"),
                         ({"image": 10**30 * -1}, "non-negative integer")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            images_per_prompt(bad)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_image_pixels must be a positive integer"):
            LimitsConfig(max_image_pixels=bad)
    with pytest.raises(ValueError, match="max_images_per_prompt must be a non-negative integer"):
        LimitsConfig(max_images_per_prompt=-1)
