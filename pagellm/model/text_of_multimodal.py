"""Multimodal checkpoints served as their text model: the text model's ``config.json`` out of
the wrapper's (its vision side is either not loaded or loaded by its own encoder)."""

from __future__ import annotations

from typing import Any

# Multimodal checkpoints served as their text model: wrapper architecture -> (the text model's
# architecture, the transformers config class whose defaults fill in its ``text_config``).
_TEXT_OF_MULTIMODAL = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    # Idefics3 / SmolVLM: a Llama text model (its vision side: ``vision_config.py``).
    "Idefics3ForConditionalGeneration": ("LlamaForCausalLM", "LlamaConfig"),
    "SmolVLMForConditionalGeneration": ("LlamaForCausalLM", "LlamaConfig"),
    # Qwen3.5 (natively multimodal): its text model under `model.language_model`.
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
}
# Wrappers that decide whether the text model's LM head is tied (their own flag, not the text config's).
_WRAPPER_TIES = {"LlamaForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"}


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint served for text (Gemma 3 4B and up:
    the vision tower is not loaded): its ``text_config`` with the defaults of transformers'
    config class filled in (the Hub's files list only what differs from them) and the
    wrapper's end-of-sequence ids. Any other config as it is."""
    architectures = config.get("architectures") or []
    if not architectures or architectures[0] not in _TEXT_OF_MULTIMODAL:
        return config
    import transformers

    architecture, class_name = _TEXT_OF_MULTIMODAL[architectures[0]]
    text = getattr(transformers, class_name)(**config.get("text_config", {})).to_dict()
    text["architectures"] = [architecture]
    wrapper_keys = ("tie_word_embeddings",) if architecture in _WRAPPER_TIES else ()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", *wrapper_keys):
        if config.get(key) is not None:
            text[key] = config[key]
    return text
