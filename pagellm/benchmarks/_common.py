"""Small helpers shared by the benchmarks: peak memory, tables, JSON, percentiles, model facts."""

from __future__ import annotations

import json
import math
import os
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Where plots and JSON go by default (gitignored); committed copies of plots live in docs/.
RESULTS_DIR = Path("benchmarks") / "results"


def bench_extra(module: str, what: str) -> Any:
    """Import ``module``, one of the ``pagellm[bench]`` extra's (plotting, the load client),
    or fail saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"{what} needs {module.split('.')[0]}: pip install 'pagellm[bench]'") from None


def flat_config(config: Any) -> dict[str, Any]:
    """A benchmark configuration for its JSON report: its engine options beside its own fields,
    one flat mapping (as the reports have always carried them)."""
    from dataclasses import asdict

    fields = asdict(config)
    engine = {("engine_" + k if k in fields else k): v for k, v in fields.pop("engine").items()}
    return {**engine, **fields}  # an engine seed beside the workload's: engine_seed


def bench_engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The engine options a benchmark passes to ``LLM``: ``EngineArgs`` fields (checked by
    name), None dropped ("the engine's default"), bfloat16 unless a dtype is given (the dtype
    of the figures in benchmarks/NOTES.md)."""
    from pagellm.engine_args import ENGINE_OPTION_NAMES

    unknown = sorted(set(options) - set(ENGINE_OPTION_NAMES))
    if unknown:
        raise ValueError(f"not engine options: {unknown}")
    return {"dtype": "bfloat16", **{k: v for k, v in options.items() if v is not None}}


# ---- memory --------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS counter (Linux ``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """Peak resident memory of this process since start (or since ``reset_peak_rss``), MiB."""
    kib = _status_kib("VmHWM")
    if kib is None:  # not Linux: lifetime peak (KiB on Linux, bytes on macOS)
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024


def current_rss_mib() -> float:
    kib = _status_kib("VmRSS")
    return kib / 1024 if kib is not None else float("nan")


# ---- statistics ----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


# ---- output --------------------------------------------------------------------------


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table. ``columns``: (key, header, format spec like '.1f' or '')."""
    header = [h for _, h, _ in columns]
    body = []
    for row in rows:
        cells = []
        for key, _, spec in columns:
            value = row.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append("-")
            elif spec:
                cells.append(format(value, spec))
            else:
                cells.append(str(value))
        body.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in body)
    return "\n".join(out)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj)}")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (CPU model, cores, torch threads and version)."""
    import platform

    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    from pagellm.config import KernelConfig
    from pagellm.kernels import kernel_target
    from pagellm.kernels.isa import isa_level, usable_cpu_flags

    config = KernelConfig.from_env()
    usable = usable_cpu_flags(config.isa_cap)
    return dict(
        cpu=cpu,
        cpu_isa=isa_level(usable),  # the level pagellm's kernels may use (PAGELLM_ISA caps it)
        kernel_target=" ".join(kernel_target(config)),  # each pagellm row's extra.kernel_plan: what ran
        cpu_flags=sorted(f for f in usable if f.startswith(("avx", "amx", "fma", "f16c"))),
        cpu_count=os.cpu_count(),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        load_average=load,
    )


# ---- model facts ---------------------------------------------------------------------


def model_token_facts(model: str | None) -> tuple[int, frozenset[int]]:
    """(vocab size, special ids to keep out of prompts) from the model's shape, no weights loaded."""
    from pagellm.model.loader import load_arch_config

    arch = load_arch_config(model)
    special = set(arch.eos_token_ids)
    if arch.bos_token_id is not None:
        special.add(arch.bos_token_id)
    return arch.vocab_size, frozenset(special)


def routes_since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Steps per route (``EngineStats.step_routes``) between two readings, most first."""
    counts = {route: n - before.get(route, 0) for route, n in after.items() if n > before.get(route, 0)}
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def format_routes(routes: dict[str, int]) -> str:
    """``12 steps decoder=fused linears=integer attention=cpu_paged; 1 step ...``."""
    return "; ".join(f"{n} step{'s' if n != 1 else ''} {route}" for route, n in routes.items()) or "none recorded"

