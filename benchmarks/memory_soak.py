"""Memory soak (issue 40): idle RSS of ``pagellm serve`` and its engine after rounds of heavy requests.

Starts the server (the default model, or ``--model``), warms it with one request, then sends
``--rounds`` rounds of the heaviest requests it takes (15 MB bodies of millions of small values,
refused; 1,024 prompts at once, served; ...) and prints, per round, the API process's peak and
idle RSS and its children's (the engine process), as a table and as JSON.

    python benchmarks/memory_soak.py [--model PATH] [--rounds 6] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers, from a checkout
from tests.helpers.server import RemoteServer  # noqa: E402

MIB = 1024 * 1024
BODIES: dict[str, tuple[str, dict]] = {
    "3M prompts (400)": ("/v1/completions", {"prompt": ["x"] * 3_000_000, "max_tokens": 1}),
    "30M-char prompt (400)": ("/v1/completions", {"prompt": "word " * 6_000_000, "max_tokens": 1}),
    "200k choices (400)": ("/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                               "guided_choice": [f"c{i}" for i in range(200_000)]}),
    "1024 prompts (200)": ("/v1/completions", {"prompt": ["hello world " * 20] * 1024, "max_tokens": 1}),
    "tokenize 1M chars": ("/tokenize", {"prompt": "word " * 200_000}),
    "chat of 20k messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}] * 20_000,
                                                     "max_tokens": 1}),
}


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def children_rss(pid: int) -> int:
    kids = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return sum(rss(k) for k in kids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    bodies = {name: (path, json.dumps(body).encode()) for name, (path, body) in BODIES.items()}
    rows = []
    with RemoteServer(args.model, ["--max-model-len", "2048", "--num-kv-blocks", "512"]) as server:
        pid = server.proc.pid
        with httpx.Client(base_url=server.base_url, timeout=600) as http:
            http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2})
            rows.append({"round": "warm-up", "api_peak_mib": rss(pid) / MIB, "api_idle_mib": rss(pid) / MIB,
                         "engine_idle_mib": children_rss(pid) / MIB})
            for r in range(args.rounds):
                peak = 0
                for path, body in bodies.values():
                    http.post(path, content=body, headers={"content-type": "application/json"})
                    peak = max(peak, rss(pid))
                rows.append({"round": r, "api_peak_mib": peak / MIB, "api_idle_mib": rss(pid) / MIB,
                             "engine_idle_mib": children_rss(pid) / MIB})
    print("| round | API peak MiB | API idle MiB | engine idle MiB |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['round']} | {row['api_peak_mib']:.0f} | {row['api_idle_mib']:.0f} | {row['engine_idle_mib']:.0f} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
