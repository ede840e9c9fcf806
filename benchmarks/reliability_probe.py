"""Reliability probe (issue 40): each hostile request that once failed, against one server.

Starts ``pagellm serve`` (the default model, or ``--model``) and sends each request while a
second client polls ``/health``; prints a table (status, seconds to answer, slowest ``/health``
meanwhile, whether the server still serves) and writes it as JSON. Run it from the repository
root on two checkouts to compare them (``PYTHONPATH=<checkout>``).

    python benchmarks/reliability_probe.py [--model PATH] [--with-3m] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers, from a checkout
from tests.helpers.server import RemoteServer  # noqa: E402

CMPL, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"


def call_history(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip


def ref_chain(length: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(length)}
    defs[f"d{length}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def cases(with_3m: bool) -> list[tuple[str, str, dict[str, Any]]]:
    deep, deeper = "[" * 10_000 + "]" * 10_000, "[" * 100_000 + "]" * 100_000
    chain = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(3000)) + '\nr3000: "b"'
    found = [
        ("guided_json text nested 10,000 deep", CMPL, {"prompt": "hi", "max_tokens": 1, "guided_json": deep}),
        ("structured_outputs.json text nested 10,000", CMPL,
         {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"json": deep}}),
        ("tool arguments nested 100,000 (chat)", CHAT, {"messages": call_history(deeper), "max_tokens": 1}),
        ("tool arguments nested 100,000 (/tokenize)", TOKENIZE, {"messages": call_history(deeper)}),
        ("tool arguments '\"just a string\"' (chat)", CHAT, {"messages": call_history('"just a string"'), "max_tokens": 1}),
        ("tool arguments '\"just a string\"' (/tokenize)", TOKENIZE, {"messages": call_history('"just a string"')}),
        ("choice list of 200,000", CMPL,
         {"prompt": "hi", "max_tokens": 1, "guided_choice": [f"choice {i}" for i in range(200_000)]}),
        ("Lark grammar, 3,000 chained rules", CMPL, {"prompt": "hi", "max_tokens": 1, "guided_grammar": chain}),
        ("JSON schema, 2,500-link $ref chain", CMPL, {"prompt": "hi", "max_tokens": 1, "guided_json": ref_chain(2500)}),
    ]  # fmt: skip
    if with_3m:
        found.append(("3 million one-character prompts", CMPL, {"prompt": ["x"] * 3_000_000, "max_tokens": 1}))
    return found


def probe(server: RemoteServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send one request while polling /health; its status, time, and the slowest poll."""
    data, out, done = json.dumps(body).encode(), {}, threading.Event()

    def send() -> None:
        start = time.monotonic()
        try:
            with httpx.Client(base_url=server.base_url, timeout=300) as http:
                response = http.post(path, content=data, headers={"content-type": "application/json"})
                out.update(status=response.status_code, message=response.text[:110])
        except httpx.HTTPError as exc:
            out.update(status=type(exc).__name__, message="")
        out["seconds"] = time.monotonic() - start
        done.set()

    sender, slowest = threading.Thread(target=send), 0.0
    sender.start()
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        while not done.is_set():
            start = time.monotonic()
            try:
                http.get("/health")
            except httpx.HTTPError:
                slowest = float("inf")
                break
            slowest = max(slowest, time.monotonic() - start)
    sender.join()
    return {**out, "slowest_health_s": slowest, "serving": server.proc.poll() is None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--with-3m", action="store_true", help="also send 3 million prompts (minutes on old servers)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rows = []
    print("| request | status | s | slowest /health s | server |\n| --- | --- | --- | --- | --- |")
    with RemoteServer(args.model, ["--max-model-len", "2048", "--num-kv-blocks", "512"]) as server:
        for name, path, body in cases(args.with_3m):
            row = {"request": name, **probe(server, path, body)}
            rows.append(row)
            state = "serving" if row["serving"] else f"dead (exit {server.proc.poll()})"
            print(f"| {name} | {row['status']} | {row['seconds']:.1f} | {row['slowest_health_s']:.2f} | {state} |",
                  flush=True)
            if not row["serving"]:
                break
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
