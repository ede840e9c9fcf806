"""Kernels are built and chosen for the CPU this process may use, not the host's /proc/cpuinfo."""

from __future__ import annotations

import pytest
import torch

from pagellm.config import KernelConfig
from pagellm.kernels import build, isa

HOST = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_bf16",
                  "amx_tile", "amx_bf16"})


def capability(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """torch's cpuid-based capability, as an emulator or a smaller CPU would report it."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: value)


def _target(cap: str = "amx", march: str | None = None) -> tuple[str, ...]:
    return build.target_flags(isa.usable_cpu_flags(cap, HOST), HOST, march)


def test_a_process_that_has_what_the_host_has_builds_native(monkeypatch: pytest.MonkeyPatch) -> None:
    capability(monkeypatch, "AVX512")
    assert isa.usable_cpu_flags("amx", HOST) == HOST and isa.isa_level(HOST) == "amx"
    assert _target() == ("-march=native",)


def test_an_emulated_avx2_cpu_gets_an_avx2_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """qemu-x86_64 -cpu Haswell: /proc/cpuinfo shows the host, cpuid (torch) shows AVX2."""
    capability(monkeypatch, "AVX2")
    usable = isa.usable_cpu_flags("amx", HOST)
    assert not any(f.startswith(("avx512", "amx")) for f in usable) and {"avx2", "fma"} <= usable
    assert isa.isa_level(usable) == "avx2" and isa.feature_summary(usable) == "avx2+fma+f16c+avx_vnni"
    assert _target() == ("-march=x86-64-v3",)
    capability(monkeypatch, "DEFAULT")
    assert "avx2" not in isa.usable_cpu_flags("amx", HOST) and _target() == ("-march=x86-64-v2",)


@pytest.mark.parametrize(
    ("cap", "level", "march"),
    [
        ("avx512", "avx512-bf16", ("-march=native", "-mno-amx-tile")),
        ("avx2", "avx2", ("-march=x86-64-v3",)),
        ("baseline", "baseline", ("-march=x86-64-v2",)),
        ("amx", "amx", ("-march=native",)),
    ],
)
def test_the_isa_option_caps_the_level(monkeypatch: pytest.MonkeyPatch, cap: str, level: str, march: tuple[str, ...]) -> None:
    capability(monkeypatch, "AVX512")
    assert isa.isa_level(isa.usable_cpu_flags(cap, HOST)) == level
    assert _target(cap) == march


def test_the_environment_is_read_into_one_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_ISA", "avx2")
    monkeypatch.setenv("PAGELLM_KERNEL_MARCH", "cooperlake")
    monkeypatch.setenv("PAGELLM_CPU_KERNELS", "0")
    config = KernelConfig.from_env()
    assert (config.isa, config.march, config.cpu_kernels, config.isa_cap) == ("avx2", "cooperlake", False, "avx2")
    assert KernelConfig.from_env(isa="avx512", cpu_kernels=None).isa == "avx512"  # an option wins, None does not
    assert _target(config.isa_cap, config.march) == ("-march=cooperlake",)  # an explicit -march wins
    monkeypatch.setenv("PAGELLM_ISA", "sse9")
    with pytest.raises(ValueError, match="isa must be one of"):
        KernelConfig.from_env()
    with pytest.raises(ValueError, match="march must be"):
        KernelConfig(march="native -O0")
    with pytest.raises(ValueError, match="isa must be one of"):
        isa.usable_cpu_flags("auto", HOST)  # the flags take a level, "auto" is the config's
