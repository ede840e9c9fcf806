"""Images through ``/v1/chat/completions`` with the official ``openai`` client: ``image_url``
parts as ``data:`` URLs, answers equal to ``transformers``' on the same conversation, and every
bad image a 400 in OpenAI's shape while the server keeps serving."""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Iterator

import openai
import pytest
import torch

from tests.helpers.server import MODEL_NAME, TINY_SERVER_ARGS, RemoteServer
from tests.helpers.tiny_vlm import png_header_only, random_image, write_tiny_idefics3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    return write_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3_server"), default_tokenizer)


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A local web server (the host the test server allows): an image, a redirect to it, a page
    that is not an image, and a missing path."""
    import http.server
    import threading

    png = io.BytesIO()
    random_image(70, 45, 1).save(png, format="PNG")
    pages = {"/cat.png": (200, "image/png", png.getvalue()), "/page": (200, "text/html", b"<html></html>"),
             "/moved": (302, "image/png", b"")}  # fmt: skip
    released = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- (the base class's name)
            if self.path == "/stall":  # headers, then a body that never comes (until the end of the module)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b"\x89PNG")
                self.wfile.flush()
                released.wait()
                return
            status, kind, body = pages.get(self.path, (404, "text/plain", b"no"))
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            if status == 302:
                self.send_header("Location", "/cat.png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    released.set()
    server.shutdown()
    thread.join()


@pytest.fixture(scope="module")
def client(vlm_path: str, image_host: str) -> Iterator[openai.OpenAI]:
    args = [*TINY_SERVER_ARGS, "--dtype", "float32", "--max-model-len", "512", "--limit-mm-per-prompt", '{"image": 2}',
            "--allowed-media-domains", image_host]  # (127.0.0.1 on the image host's port only)
    with RemoteServer(vlm_path, args) as server, server.client(timeout=60.0) as c:
        yield c


def data_url(image, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


def user_turn(text: str, urls: list[str]) -> list[dict]:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


@functools.cache
def _reference(vlm_path: str):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(vlm_path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(vlm_path)


def hf_answer(vlm_path: str, text: str, images: list, max_tokens: int) -> str:
    """The reference: the same conversation (parts joined, each image its placeholder) rendered
    by the tokenizer's template, preprocessed by the model's own processor, decoded greedily."""
    model, processor = _reference(vlm_path)
    content = "\n".join([text] + ["<image>"] * len(images))
    prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                     add_generation_prompt=True)  # fmt: skip
    inputs = processor(text=prompt, images=[images], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_image_url_parts_answer_as_transformers_does(client: openai.OpenAI, vlm_path: str) -> None:
    images = [random_image(70, 45, 1), random_image(30, 30, 2)]
    for fmt in ("PNG", "WEBP"):  # (lossless WebP: the same pixels)
        urls = [data_url(image, fmt) if fmt == "PNG" else _webp_url(image) for image in images]
        result = client.chat.completions.create(model=MODEL_NAME, messages=user_turn("Compare:", urls), max_tokens=8,
                                                temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert result.choices[0].message.content == hf_answer(vlm_path, "Compare:", images, 8)
        assert result.usage.prompt_tokens > 2 * 16  # two images' tokens at least


def _webp_url(image) -> str:
    out = io.BytesIO()
    image.save(out, format="WEBP", lossless=True)
    return "data:image/webp;base64," + base64.b64encode(out.getvalue()).decode()


def _bmp() -> bytes:
    out = io.BytesIO()
    random_image(8, 8, 0).save(out, format="BMP")
    return out.getvalue()


def _png_b64(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


BAD = {
    "a remote URL": ("https://example.com/cat.png", "URLs of 'example.com' are not fetched"),
    "not a data URL": ("file:///etc/passwd", "must be a data:image"),
    "bad base64": ("data:image/png;base64,@@@@", "not valid base64"),
    "another media type": ("data:image/bmp;base64,Qk0=", "is not one of"),
    "an undecodable file": (_png_b64(b"\x89PNG\r\n\x1a\nnot really"), "could not be read"),
    "20,000 x 20,000 pixels": (_png_b64(png_header_only(20_000, 20_000)), "could not be read|more than the limit"),
    "9,000 x 9,000 pixels": (_png_b64(png_header_only(9_000, 9_000)), "9000 x 9000 pixels: more than the limit"),
    "a file of another format": ("data:image/png;base64," + base64.b64encode(_bmp()).decode(), "could not be read"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_image_is_a_400_and_the_server_serves_on(client: openai.OpenAI, case: str) -> None:
    url, message = BAD[case]
    with pytest.raises(openai.BadRequestError, match=message) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=user_turn("What?", [url]), max_tokens=2)
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == "messages"
    ok = client.chat.completions.create(model=MODEL_NAME, messages=user_turn("What?", [data_url(random_image(9, 9, 0))]),
                                        max_tokens=2)  # fmt: skip
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_metrics_count_images_and_encodings(client: openai.OpenAI) -> None:
    import httpx

    def counters() -> dict[str, float]:
        text = httpx.get(str(client.base_url).replace("/v1/", "/metrics")).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith(("pagellm:mm_images_total", "pagellm:mm_images_encoded_total"))}  # fmt: skip

    before = counters()
    url = data_url(random_image(33, 33, 81))
    for _ in range(2):  # the same image twice: taken twice, encoded once
        client.chat.completions.create(model=MODEL_NAME, messages=user_turn("Again:", [url]), max_tokens=1)
    after = counters()
    key = next(k for k in after if k.startswith("pagellm:mm_images_total"))
    encoded = next(k for k in after if k.startswith("pagellm:mm_images_encoded_total"))
    assert after[key] - before.get(key, 0) == 2 and after[encoded] - before.get(encoded, 0) == 1


def test_more_images_than_the_limit_are_refused_before_decoding(client: openai.OpenAI) -> None:
    urls = ["data:image/png;base64,AAAA"] * 1000  # (not even valid images: the count is checked first)
    with pytest.raises(openai.BadRequestError, match="1000 images, more than the limit of 2"):
        client.chat.completions.create(model=MODEL_NAME, messages=user_turn("Many", urls), max_tokens=2)


def test_tokenize_counts_each_image_as_chat_does(client: openai.OpenAI, vlm_path: str) -> None:
    import httpx

    image = random_image(70, 45, 1)
    messages = user_turn("Count:", [data_url(image)])
    tokens = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"messages": messages}).json()["tokens"]
    result = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert len(tokens) == result.usage.prompt_tokens
    assert tokens.count(_image_token_id(vlm_path)) == 7 * 16  # 2 x 3 tiles and the whole image, 16 tokens each


def _image_token_id(vlm_path: str) -> int:
    import json
    from pathlib import Path

    return json.loads((Path(vlm_path) / "config.json").read_text())["image_token_id"]


def test_anthropic_and_responses_images_answer_as_chat_does(client: openai.OpenAI, vlm_path: str) -> None:
    """The same image and question through /v1/messages (the ``anthropic`` client, a base64
    source) and /v1/responses (``input_image``) gives chat's greedy answer."""
    import anthropic

    image = random_image(50, 40, 7)
    url = data_url(image)
    expected = hf_answer(vlm_path, "Describe:", [image], 6)
    base = str(client.base_url).removesuffix("/v1/")
    with anthropic.Anthropic(base_url=base, api_key="none") as claude:
        message = claude.messages.create(model=MODEL_NAME, max_tokens=6, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}},
        ]}], extra_body={"ignore_eos": True, "temperature": 0})  # fmt: skip
    assert message.content[0].text == expected
    response = client.responses.create(model=MODEL_NAME, max_output_tokens=6, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe:"}, {"type": "input_image", "image_url": url}]}],
        extra_body={"ignore_eos": True})  # fmt: skip
    assert response.output_text == expected
    with anthropic.Anthropic(base_url=base, api_key="none") as claude, pytest.raises(anthropic.BadRequestError,
                                                                                        match="not fetched"):
        claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])  # fmt: skip


def test_images_outside_a_user_message_are_a_400(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Rules"}, {"type": "image_url", "image_url": {"url": data_url(random_image(9, 9, 0))}}]
    with pytest.raises(openai.BadRequestError, match="images go in user messages"):
        client.chat.completions.create(model=MODEL_NAME, max_tokens=2, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}], messages=[{"role": "system", "content": parts},
                                                                        {"role": "user", "content": "Hi"}])  # fmt: skip


def test_an_allowed_hosts_image_url_is_fetched(client: openai.OpenAI, vlm_path: str, image_host: str) -> None:
    """``--allowed-media-domains 127.0.0.1:PORT``: its URLs are fetched (the answer is the inline
    image's); a redirect, a missing image, a page that is not an image, another host, another
    port of the same host and a URL that does not parse are 400s."""
    answer = client.chat.completions.create(model=MODEL_NAME, messages=user_turn("Compare:", [f"http://{image_host}/cat.png"]),
                                            max_tokens=8, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert answer.choices[0].message.content == hf_answer(vlm_path, "Compare:", [random_image(70, 45, 1)], 8)
    port = image_host.split(":")[1]
    for url, message in [(f"http://{image_host}/moved", "HTTP 302"), (f"http://{image_host}/gone", "HTTP 404"),
                         (f"http://{image_host}/page", "'text/html' is not one of"),
                         (f"http://localhost:{port}/cat.png", f"URLs of 'localhost:{port}' are not fetched"),
                         (f"http://127.0.0.1:{int(port) + 1}/cat.png", f"URLs of '127.0.0.1:{int(port) + 1}' are not"),
                         ("http://127.0.0.1:abc/x", "not a valid URL"), ("http://127.0.0.1/cat.png", "are not fetched")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model=MODEL_NAME, messages=user_turn("What?", [url]), max_tokens=2)


def test_a_stalled_fetch_ends_at_its_deadline_and_host_entries_are_checked(image_host: str) -> None:
    """A body that never comes fails the fetch once its time is up (a 400 for the request, not a
    worker thread held); malformed --allowed-media-domains entries are refused at start."""
    from pagellm.entrypoints.media import MediaPolicy, allowed_hosts

    policy = MediaPolicy(allowed_hosts([image_host]), timeout_s=0.5)
    with pytest.raises(ValueError, match="could not be fetched|took too long"):
        policy.image(f"http://{image_host}/stall", 10**6)
    assert allowed_hosts(["Images.Example.com", "h:8080"]) == {("images.example.com", None), ("h", 8080)}
    for bad in ("https://images.example.com", "images.example.com/path", "h:port", ""):
        with pytest.raises(ValueError, match="takes host names"):
            allowed_hosts([bad])
