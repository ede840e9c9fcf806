"""Tokenizers load offline, carry a chat template, and round-trip text."""

from __future__ import annotations

from pathlib import Path

from pagellm.model import load_tokenizer

TEXT = "Hello, world! Paged attention: 42 tokens/s. Ünïcödé too."


def test_gguf_tokenizer_has_chat_template_and_round_trips(default_tokenizer) -> None:
    assert (default_tokenizer.bos_token_id, default_tokenizer.eos_token_id) == (1, 2)
    assert default_tokenizer.eos_token == "<|im_end|>"
    assert len(default_tokenizer) == 49152
    ids = default_tokenizer.encode(TEXT)
    assert ids[0] != default_tokenizer.bos_token_id  # the GGUF says add_bos_token=False
    assert default_tokenizer.decode(ids) == TEXT
    assert "<|im_start|>" in default_tokenizer.chat_template
    prompt = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_hf_folder_tokenizer(tiny_llama_path: str) -> None:
    tokenizer = load_tokenizer(tiny_llama_path)
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_chat_template_override(tmp_path: Path, tiny_qwen2_path: str) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tokenizer = load_tokenizer(tiny_qwen2_path, chat_template_path=str(template))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "yo"}], tokenize=False)
    assert text == "[user] yo\n"


def test_caches_are_private_and_foreign_ones_unused(tmp_path, monkeypatch) -> None:
    """Kernel and tokenizer caches are created 0700; a cache others may write is not trusted."""
    import os
    import stat

    from pagellm.utils import owned_by_me, private_dir

    cache = tmp_path / "pagellm" / "kernels"
    assert private_dir(cache) and stat.S_IMODE(cache.stat().st_mode) == 0o700
    cache.chmod(0o777)
    assert private_dir(cache) and stat.S_IMODE(cache.stat().st_mode) == 0o700  # ours: tightened
    shared_object = cache / "cpu_kernels-x.so"
    shared_object.write_bytes(b"")
    shared_object.chmod(0o666)
    assert not owned_by_me(shared_object)
    shared_object.chmod(0o755)
    assert owned_by_me(shared_object)
    monkeypatch.setattr(os, "getuid", lambda: 12345)  # as another user would see our folder
    assert not private_dir(cache) and not owned_by_me(shared_object)


def test_cached_gguf_tokenizer_loads_as_auto_tokenizer_does(default_tokenizer) -> None:
    """A cached GGUF tokenizer of the plain class loads without ``AutoTokenizer`` (whose import
    scans every model file of transformers) and is the tokenizer ``AutoTokenizer`` gives."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from pagellm.model.loader import resolve_model_path
    from pagellm.model.tokenizer import _cache_key, tokenizer_cache_dir

    folder = tokenizer_cache_dir() / _cache_key(Path(resolve_model_path(None)))  # the fixture built it
    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert type(auto) is type(default_tokenizer) and auto.get_vocab() == default_tokenizer.get_vocab()
    assert auto.encode(TEXT) == default_tokenizer.encode(TEXT)
    assert auto.chat_template == default_tokenizer.chat_template
    assert auto.special_tokens_map == default_tokenizer.special_tokens_map
    code = "import sys; from pagellm.model import load_tokenizer; load_tokenizer(None); print('transformers.models' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_model_folder_tokenizer_of_the_plain_class_skips_the_model_scan(default_tokenizer, tmp_path) -> None:
    """A Hugging Face folder whose tokenizer is the plain class (Llama 3's ``tokenizer.json``
    alone) loads without importing ``transformers.models``, the tokenizer ``AutoTokenizer`` gives."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    default_tokenizer.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ours = load_tokenizer(str(tmp_path))
    auto = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert ours.get_vocab() == auto.get_vocab() and ours.encode(TEXT) == auto.encode(TEXT)
    assert ours.chat_template == auto.chat_template and ours.special_tokens_map == auto.special_tokens_map
    code = (f"import sys; from pagellm.model import load_tokenizer; load_tokenizer({str(tmp_path)!r}); "
            "print('transformers.models' in sys.modules)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
