"""What this CPU can run: its feature flags, cut down to the level this process may use.

Detected once per process (the host's flags and torch's cpuid-based capability do not change
while it runs); :class:`pagellm.config.KernelConfig` ``isa`` caps the level further.
"""

from __future__ import annotations

from functools import lru_cache

# The ISA levels pagellm's kernels are built for, lowest first.
ISA_LEVELS = ("baseline", "avx2", "avx512", "amx")
_AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "avx_vnni"})
# The flags the kernel plan reports (start-up log, /version, bench JSON), in this order.
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_bf16",
                  "avx512_vnni", "avx512vbmi", "amx_bf16", "amx_int8")


@lru_cache(maxsize=1)
def host_cpu_flags() -> frozenset[str]:
    """The CPU feature flags the OS reports ("flags" on x86, "Features" on aarch64); empty
    where /proc/cpuinfo is unavailable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _process_level() -> str:
    """The highest level cpuid lets this process use, as torch sees it."""
    import torch

    return {"AVX512": "amx", "AVX2": "avx2", "DEFAULT": "baseline"}.get(torch.backends.cpu.get_cpu_capability(), "amx")


def _is_avx512_or_amx(flag: str) -> bool:
    return flag.startswith(("avx512", "amx"))


def usable_cpu_flags(cap: str = "amx", host: frozenset[str] | None = None) -> frozenset[str]:
    """The CPU flags this process may use: the host's, less the levels it cannot use.

    /proc/cpuinfo lists the host CPU's flags, but a process under an emulator (``qemu-x86_64
    -cpu Haswell``) runs on less. torch's CPU capability comes from cpuid as this process sees
    it; where it reports no AVX-512 (or not even AVX2), those levels' flags are dropped. ``cap``
    (one of :data:`ISA_LEVELS`) caps the level further, to run a lower path.
    """
    if cap not in ISA_LEVELS:
        raise ValueError(f"isa must be one of {', '.join(ISA_LEVELS)}, got {cap!r}")
    flags = host_cpu_flags() if host is None else host
    if "avx2" not in flags and "avx512f" not in flags:
        return flags  # not an x86 CPU of those levels: nothing to drop
    level = min(_process_level(), cap, key=ISA_LEVELS.index)
    if level == "avx512":
        return frozenset(f for f in flags if not f.startswith("amx"))
    if level == "avx2":
        return frozenset(f for f in flags if not _is_avx512_or_amx(f))
    if level == "baseline":
        return frozenset(f for f in flags if not _is_avx512_or_amx(f) and f not in _AVX2_FLAGS)
    return flags


def isa_level(flags: frozenset[str]) -> str:
    """A short name of what ``flags`` allow: amx, avx512-bf16, avx512, avx2 or baseline."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "baseline"


def feature_summary(flags: frozenset[str]) -> str:
    """``avx2+fma+f16c``-style list of the flags that matter to the kernels (or "baseline")."""
    return "+".join(f for f in REPORTED_FLAGS if f in flags) or "baseline"
