"""Build the C++ CPU kernels once per machine and load them with ctypes.

The sources (``csrc/*.cpp``, split by concern over the headers they share) use no torch headers,
so one ``g++ -O3 -march=... -fopenmp`` call takes about a second; it has AVX-512 BF16 paths and
portable C++ fallbacks, and is built once per ISA level (:func:`target_flags`): one shared
object per ``-march``, so one process can load the AVX2 build next to its native one. Each is
cached under
``$PAGELLM_CACHE_DIR/kernels`` (default ``~/.cache/pagellm/kernels``), keyed by a hash of the
source, the compiler, its flags and this CPU's feature flags, and written atomically, so
concurrent processes never load a half-written file; a lock file next to it (``.so.lock``) makes
a second process that wants the same build wait for the first one's instead of compiling it
again (e.g. the test workers of ``pytest -n``). Anything that goes wrong (no compiler,
a failed build) makes :func:`load_library` return ``None`` and the kernel plan falls back to
pure PyTorch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources
from pathlib import Path

from pagellm.utils import owned_by_me, private_dir

logger = logging.getLogger(__name__)

ABI_VERSION = 27
_SOURCES = ("attention.cpp", "elementwise.cpp", "gemm_bf16.cpp", "gemm_avx2.cpp", "gemm_int8.cpp", "decoder_stack.cpp",
            "shm_all_reduce.cpp", "memory_read.cpp", "gguf_rows.cpp", "pack_panels.cpp", "lora.cpp", "scan.cpp")
_HEADERS = (
    "amx_bf16_tiles.h", "attention_avx2.h", "attention_avx512.h", "attention_common.h", "avx2_simd.h", "bf16_simd.h",
    "cpu_common.h", "exports.h", "gemm_int8_amx.h", "gemm_int8_bf16_tiles.h", "gemm_int8_layout.h", "gemm_int8_q4k.h",
    "gemm_int8_quantize.h", "gemm_int8_simd.h", "gemm_int8_unpacked.h", "work_ranges.h",
)
# -ffp-contract=off: no fused multiply-adds where the source has a product then a sum, so the
# elementwise kernels round exactly like the separate torch ops they replace.
_BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-ffp-contract=off")


def target_flags(usable: frozenset[str], host: frozenset[str], march: str | None = None) -> tuple[str, ...]:
    """The ``-march`` for the CPU flags this process may use (``usable``), not the host's.

    ``-march=native`` describes the host, which can be more than the process has (an emulator,
    an ISA cap): then the build targets the level the process has. ``march`` overrides it all
    (e.g. x86-64-v2 to build and test the portable path on an AVX-512 machine).
    """
    if march:
        return (f"-march={march}",)
    if usable == host:
        return ("-march=native",)
    if "avx512f" in usable:
        return ("-march=native", "-mno-amx-tile")  # only AMX is left out (its dependants with it)
    if {"avx2", "fma"} <= usable:
        return ("-march=x86-64-v3",)
    return ("-march=x86-64-v2",)


def cache_dir() -> Path:
    """Where built kernels are kept; created private (0700), and used only while it is."""
    root = os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagellm")
    return Path(root) / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _read_sources() -> dict[str, str]:
    """Every file of the build (sources and headers) by name."""
    folder = resources.files("pagellm.kernels").joinpath("csrc")
    return {name: folder.joinpath(name).read_text(encoding="utf-8") for name in (*_SOURCES, *_HEADERS)}


def _compile(cxx: str, flags: tuple[str, ...], files: dict[str, str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        out = Path(tmp) / target.name
        sources = [str(Path(tmp) / name) for name in _SOURCES]
        proc = subprocess.run([cxx, *flags, *sources, "-o", str(out)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-4000:]}")
        os.replace(out, target)


_STALE_AFTER_S = 7 * 24 * 3600


def _remove_stale(folder: Path) -> None:
    """Drop builds of other sources/flags untouched for a week (a loaded one stays mapped), and
    their lock files (:func:`_build_lock` touches the one it takes)."""
    now = time.time()
    for old in [*folder.glob("cpu_kernels-*.so"), *folder.glob("cpu_kernels-*.so.lock")]:
        try:
            if now - old.stat().st_mtime > _STALE_AFTER_S:
                old.unlink()
        except OSError:
            pass


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``target``'s lock file (``flock``: released when the process
    ends, however it ends), so only one process at a time builds that target. Where no lock can
    be taken, builds may overlap: each still replaces the file atomically."""
    try:
        import fcntl

        fd = os.open(str(target) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.utime(fd)  # in use: not stale
        yield
    finally:
        os.close(fd)


_P, _I64, _I32, _F32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_double
# Every function the library exports: (return type, argument types). One table, read by
# _declare: a wrong-arity or wrong-type call then fails in ctypes, never in the C++.
_SIGNATURES: dict[str, tuple[type, list[type]]] = {
    "pagellm_abi_version": (_I32, []),
    "pagellm_paged_attention": (
        _I32, [_P, _I64, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _P, _I32,
               _I32],
    ),
    "pagellm_write_kv": (_I32, [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I32, _I32]),
    "pagellm_add_rms_norm": (_I32, [_P, _P, _P, _P, _I64, _I64, _F32, _I32, _I32, _I32]),
    "pagellm_head_rms_norm": (_I32, [_P, _I64, _I64, _I64, _I64, _P, _F32, _I32, _I32, _I32]),
    "pagellm_rotary": (_I32, [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I32, _I32]),
    "pagellm_mamba2_decode": (
        _I32, [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _P, _P, _P, _P, _F32, _F32, _P, _F32, _I64,
               _I64, _I64, _I64, _P, _I64, _I32, _I32],
    ),
    "pagellm_delta_net_decode": (
        _I32, [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _P, _P, _P, _P, _F32, _I64, _I64, _I64, _I64,
               _I32, _P, _I64, _I32, _I32],
    ),
    "pagellm_argmax_rows": (_I32, [_P, _I64, _I64, _I64, _P, _I32, _I32]),
    "pagellm_apply_token_bitmask": (_I32, [_P, _I64, _I64, _I64, _P, _I64, _P, _I32, _I32]),
    "pagellm_gemm_bf16_available": (_I32, []),
    "pagellm_gemm_bf16": (_I32, [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I32, _I32, _I32]),
    "pagellm_gemm_bf16_amx_available": (_I32, []),
    "pagellm_gemm_avx2_available": (_I32, []),
    "pagellm_gemm_avx2": (_I32, [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I32, _I32, _I32, _I32]),
    "pagellm_silu_mul": (_I32, [_P, _I64, _I64, _P, _I32, _I32]),
    "pagellm_bias_gelu_tanh": (_I32, [_P, _I64, _I64, _P, _P, _I32, _I32]),
    "pagellm_lora_add": (_I32, [_P, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I32, _I32]),
    "pagellm_gemm_q_isa": (_I32, []),
    "pagellm_gemm_q_runs_here": (_I32, []),
    "pagellm_quantize_rows": (_I32, [_P, _I64, _I64, _I64, _I32, _P, _P, _P, _I32, _I32]),
    "pagellm_gemm_q_amx_available": (_I32, []),
    "pagellm_gemm_q": (_I32, [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I32, _I32, _I32, _I32, _I32]),
    "pagellm_dequant_q_bf16": (_I32, [_P, _I64, _I64, _I32, _I32, _P, _I32]),
    "pagellm_pack_pairs": (_I32, [_P, _P, _I64, _I64, _I64, _P, _I32]),
    "pagellm_decoder_stack": (_I32, [_P]),
    "pagellm_read_sum": (_I32, [_P, _I64, _I32, _P]),
    "pagellm_pack_gguf": (_I32, [_I32, _P, _P, _I64, _I64, _P, _I32]),
    "pagellm_dequant_gguf_rows": (_I32, [_I32, _P, _P, _I64, _I64, _P, _I32]),
    "pagellm_shm_region_bytes": (_I64, [_I32, _I64]),
    "pagellm_shm_register": (None, [_P, _I32, _I64]),  # type: ignore[dict-item]
    "pagellm_shm_all_reduce": (_I32, [_P, _I32, _I32, _P, _I64, _I64, ctypes.c_uint64, _F64]),
}


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes


@lru_cache(maxsize=None)
def load_library(march: tuple[str, ...], machine_id: str) -> ctypes.CDLL | None:
    """The kernel library built for ``march`` (on a CPU whose usable flags ``machine_id``
    lists: what a ``-march=native`` build depends on), building it if needed; ``None`` when
    unavailable. One shared object per target, each kept for the life of the process."""
    import torch  # noqa: F401  -- load torch's libgomp first so the kernels share its OpenMP runtime

    cxx = _compiler()
    if cxx is None:
        logger.info("no C++ compiler found; CPU kernels disabled, using the PyTorch attention path")
        return None
    files = _read_sources()
    flags = (*march, *_BASE_FLAGS)
    key = hashlib.sha256(
        "\0".join([*files.values(), cxx, _compiler_version(cxx), " ".join(flags), machine_id or platform.processor()]).encode()
    ).hexdigest()[:20]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    try:
        if not private_dir(target.parent) or (target.exists() and not owned_by_me(target)):
            # Never load a shared object someone else could have put there.
            logger.warning("the kernel cache %s is not private to this user; building elsewhere", target.parent)
            target = Path(tempfile.mkdtemp(prefix="pagellm-kernels-")) / target.name
        if not target.exists():
            with _build_lock(target):
                if not target.exists():  # not built by another process while we waited
                    _remove_stale(target.parent)
                    try:
                        _compile(cxx, flags, files, target)
                    except OSError:  # cache folder not writable: build into a private temporary folder
                        target = Path(tempfile.mkdtemp(prefix="pagellm-kernels-")) / target.name
                        _compile(cxx, flags, files, target)
        lib = ctypes.CDLL(str(target))
        _declare(lib)
        if lib.pagellm_abi_version() != ABI_VERSION:
            raise RuntimeError("kernel ABI version mismatch")
    except Exception as exc:  # noqa: BLE001 -- any failure means: fall back to PyTorch
        logger.warning("CPU kernels unavailable (%s); using the PyTorch attention path", exc)
        return None
    return lib
