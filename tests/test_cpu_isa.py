"""Kernels are built and chosen for the CPU this process may use, not the host's /proc/cpuinfo."""

from __future__ import annotations

import pytest
import torch

from pagellm import utils
from pagellm.kernels import build

HOST = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_bf16",
                  "amx_tile", "amx_bf16"})


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An AMX host as /proc/cpuinfo would show it; torch's cpuid-based capability set per test."""
    monkeypatch.setattr(utils, "cpu_flags", lambda: HOST)
    monkeypatch.setattr(build, "cpu_flags", lambda: HOST)
    monkeypatch.delenv("PAGELLM_ISA", raising=False)
    monkeypatch.delenv("PAGELLM_KERNEL_MARCH", raising=False)
    return monkeypatch


def capability(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: value)


def test_a_process_that_has_what_the_host_has_builds_native(host: pytest.MonkeyPatch) -> None:
    capability(host, "AVX512")
    assert utils.usable_cpu_flags() == HOST and utils.isa_level(HOST) == "amx"
    assert build.target_flags() == ("-march=native",)


def test_an_emulated_avx2_cpu_gets_an_avx2_build(host: pytest.MonkeyPatch) -> None:
    """qemu-x86_64 -cpu Haswell: /proc/cpuinfo shows the host, cpuid (torch) shows AVX2."""
    capability(host, "AVX2")
    usable = utils.usable_cpu_flags()
    assert not any(f.startswith(("avx512", "amx")) for f in usable) and {"avx2", "fma"} <= usable
    assert utils.isa_level(usable) == "avx2"
    assert build.target_flags() == ("-march=x86-64-v3",)
    capability(host, "DEFAULT")
    assert "avx2" not in utils.usable_cpu_flags() and build.target_flags() == ("-march=x86-64-v2",)


@pytest.mark.parametrize(
    ("isa", "level", "march"),
    [
        ("avx512", "avx512-bf16", ("-march=native", "-mno-amx-tile")),
        ("avx2", "avx2", ("-march=x86-64-v3",)),
        ("baseline", "baseline", ("-march=x86-64-v2",)),
        ("amx", "amx", ("-march=native",)),
    ],
)
def test_pagellm_isa_caps_the_level(host: pytest.MonkeyPatch, isa: str, level: str, march: tuple[str, ...]) -> None:
    capability(host, "AVX512")
    host.setenv("PAGELLM_ISA", isa)
    assert utils.isa_level(utils.usable_cpu_flags()) == level
    assert build.target_flags() == march


def test_a_bad_isa_name_and_a_forced_march(host: pytest.MonkeyPatch) -> None:
    capability(host, "AVX512")
    host.setenv("PAGELLM_ISA", "sse9")
    with pytest.raises(ValueError, match="PAGELLM_ISA must be one of"):
        utils.usable_cpu_flags()
    host.setenv("PAGELLM_ISA", "avx2")
    host.setenv("PAGELLM_KERNEL_MARCH", "cooperlake")
    assert build.target_flags() == ("-march=cooperlake",)  # an explicit -march wins
