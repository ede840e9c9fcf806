"""The llama.cpp family as references for ``pagellm bench latency``: llama.cpp's and
ik_llama.cpp's own benchmark, ``llama-bench``, run on the same GGUF file with the same prompt
length, generated tokens and threads, CPU only.

Each peer has its executable (``--llama-bench PATH``, ``--ik-llama-bench PATH``) and extra
arguments: ik_llama.cpp's default is ``-rtr 1`` (repack the file's blocks at load into its
row-interleaved formats of the same bits per weight, its fastest CPU path). The latency benchmark
runs one repetition of each peer after each of pagellm's timed requests, so a shared machine's
slow and fast phases fall on every engine alike, and reports each peer's median over those runs.
Building both: docs/llama-bench.md.
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from typing import Any

LLAMA_BENCH_DOC = "docs/llama-bench.md"
# Fields of a llama-bench JSON entry kept in the report: which build, CPU and model it measured.
_BUILD_INFO = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "n_threads")


@dataclass(frozen=True)
class Peer:
    """One engine of the llama.cpp family that ``--compare NAME`` runs through its llama-bench."""

    name: str  # the --compare value
    label: str  # as printed
    binary_option: str  # the CLI option naming its llama-bench
    default_args: tuple[str, ...] = ()
    # How its llama-bench times decode after a prompt: "-d" (``-n M -d N``: llama.cpp) or "-gp"
    # (``-gp N,M``: ik_llama.cpp).
    depth_option: str = "-d"


PEERS: dict[str, Peer] = {
    "llamacpp": Peer("llamacpp", "llama.cpp", "--llama-bench"),
    "ik_llama": Peer("ik_llama", "ik_llama.cpp", "--ik-llama-bench", ("-rtr", "1"), "-gp"),
}


def peer_binary(peer: Peer, path: str | None) -> str:
    """The peer's llama-bench executable; fails up front, saying how to build it, when it is not there."""
    how = f"build it as described in {LLAMA_BENCH_DOC} and pass {peer.binary_option} PATH"
    if not path:
        raise FileNotFoundError(f"--compare {peer.name} needs {peer.label}'s llama-bench: {how}")
    found = shutil.which(path)  # a path or a name on PATH; None unless an executable file
    if found is None:
        raise FileNotFoundError(f"{peer.label}'s llama-bench not found (or not executable) at {path!r}: {how}")
    return found


def gguf_model_path(model: str | None) -> str:
    """The GGUF file every engine loads: llama-bench reads only GGUF, so anything else is refused."""
    from pagellm.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        raise ValueError(f"--compare needs a .gguf model (llama-bench reads only GGUF), got {path}")
    return path


def bench_commands(peer: Peer, binary: str, model_path: str, input_len: int, output_len: int, threads: int,
                   repeats: int = 1, extra_args: tuple[str, ...] | list[str] = ()) -> list[list[str]]:  # fmt: skip
    """llama-bench runs that mirror pagellm's: the same file and threads, CPU only; a prefill of
    ``input_len`` tokens, and ``output_len`` decoded tokens after ``input_len`` in context, as
    pagellm decodes after its prompt (llama-bench's plain ``-n`` starts from an empty context: at
    4,096 tokens a 1B model's decode reads 135 MB less K/V a token there)."""
    common = ["-r", str(repeats), "-t", str(threads), "-ngl", "0", *extra_args, "-o", "json"]
    prefill = [binary, "-m", model_path, "-p", str(input_len), "-n", "0"]
    if peer.depth_option == "-gp":  # (one run: the prefill test, then decode after a prompt)
        return [[*prefill, "-gp", f"{input_len},{output_len}", *common]]
    return [[*prefill, *common], [binary, "-m", model_path, "-p", "0", "-n", str(output_len), "-d", str(input_len), *common]]


def llama_bench_entries(text: str) -> list[dict[str, Any]]:
    """The tests of one ``llama-bench -o json`` stdout."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"no JSON array in llama-bench output: {text[:200]!r}")
    return json.loads(text[start:])


def parse_llama_bench(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Prefill and decode tok/s from llama-bench's tests: one pp entry (n_gen 0), one tg (its
    context before it in ``decode_depth``: n_prompt with ``-gp``, n_depth with ``-d``)."""
    prefill = [e for e in entries if e["n_prompt"] > 0 and e["n_gen"] == 0]
    decode = [e for e in entries if e["n_gen"] > 0]
    if len(prefill) != 1 or len(decode) != 1:
        raise ValueError(f"expected one prefill and one decode test from llama-bench, "
                         f"got {len(prefill)} and {len(decode)}")
    pp, tg = prefill[0], decode[0]
    return dict(
        prefill_tokens_per_s=float(pp["avg_ts"]), prefill_stddev_tokens_per_s=float(pp["stddev_ts"]),
        decode_tokens_per_s=float(tg["avg_ts"]), decode_stddev_tokens_per_s=float(tg["stddev_ts"]),
        n_prompt=int(pp["n_prompt"]), n_gen=int(tg["n_gen"]), decode_depth=int(tg["n_prompt"]) + int(tg.get("n_depth", 0)),
        build={k: pp[k] for k in _BUILD_INFO if k in pp},
    )  # fmt: skip


def run_llama_bench(commands: list[list[str]]) -> dict[str, Any]:
    """Run llama-bench's commands and parse their tests together; on a failure its stderr is
    shown, since that is where it says why."""
    entries: list[dict[str, Any]] = []
    for command in commands:
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {shlex.join(command)}\n{proc.stderr[-2000:]}")
        entries += llama_bench_entries(proc.stdout)
    return dict(parse_llama_bench(entries), command=" && ".join(shlex.join(command) for command in commands))


def combine_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A peer's figures over its interleaved runs: each phase's median tok/s, every run's rate,
    their spread, and the first run's facts (lengths, build, command)."""
    combined = dict(runs[0], runs=len(runs))
    for phase in ("prefill", "decode"):
        rates = [run[f"{phase}_tokens_per_s"] for run in runs]
        combined[f"{phase}_tokens_per_s"] = statistics.median(rates)
        combined[f"{phase}_runs_tokens_per_s"] = rates
        combined[f"{phase}_stddev_tokens_per_s"] = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return combined


def ratios(ours: dict[str, float], theirs: dict[str, Any]) -> dict[str, float]:
    """pagellm's median tok/s over a peer's, per phase: above 1 means pagellm is faster."""
    return dict(prefill=ours["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"],
                decode=ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"])
