"""Find a model on disk, read its shape, and build it with its weights.

A model is (a) a local Hugging Face folder (``config.json`` + ``*.safetensors``, sharded or
not), (b) a ``.gguf`` file, or (c) a folder holding exactly one ``.gguf``. ``None`` means
the default model. Pickle checkpoints (``*.bin``/``*.pt``/``*.pth``) are refused: loading
them can execute arbitrary code.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagellm.attention.backend import AttentionBackend
from pagellm.config import ModelConfig
from pagellm.distributed.parallel_state import ParallelRank
from pagellm.distributed.pipeline import PipelineStage
from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.library import KernelLibrary
from pagellm.kernels.plan import KernelPlan, WeightRequest
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.default_model import default_model_path
from pagellm.model.gguf_loader import arch_config_from_gguf, has_quantized_linears, iter_gguf_weights, open_gguf
from pagellm.model.idefics3_vision import Idefics3Vision
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.mtp import mtp_layer_count
from pagellm.model.mxfp4 import join_mxfp4_pairs
from pagellm.model.packed_weights_cache import PackedWeightsCache
from pagellm.model.registry import validate_arch_config
from pagellm.model.text_of_multimodal import text_model_config
from pagellm.model.vision_config import VisionSpec

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_SAFETENSORS_INDEX = "model.safetensors.index.json"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_model_path(model: str | None) -> str:
    """The concrete path to load: an HF folder, or a ``.gguf`` file (default model for None)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a model folder")
        return str(path)
    if (path / "config.json").is_file():
        return str(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"{path} holds several .gguf files ({', '.join(g.name for g in ggufs)}); pass one of them")
    _refuse_pickle_only(path)
    raise FileNotFoundError(f"{path} has no config.json (and no .gguf file); not a model folder")


def is_gguf(path: str) -> bool:
    """Whether a resolved model path is a GGUF file."""
    return path.endswith(".gguf") and Path(path).is_file()


def _refuse_pickle_only(folder: Path) -> None:
    """ValueError when the folder's only weights are pickle files."""
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles and not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"{folder} only has pickle checkpoints ({', '.join(pickles)}); pickle checkpoints are refused "
            f"for safety (loading them can run arbitrary code). Convert the weights to safetensors."
        )


def safetensors_files(folder: str) -> list[Path]:
    """The checkpoint's safetensors shards (from the index when present, else by glob)."""
    root = Path(folder)
    index = root / _SAFETENSORS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    _refuse_pickle_only(root)
    raise FileNotFoundError(f"no *.safetensors weights found in {root}")


def _read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file; FileNotFoundError naming it if absent."""
    if not path.is_file():
        raise FileNotFoundError(f"missing {path.name} in {path.parent}")
    return json.loads(path.read_text())


def _hf_arch_config(folder: str) -> ModelArchConfig:
    """ModelArchConfig from ``config.json`` plus ``generation_config.json`` when present."""
    root = Path(folder)
    config = _read_json(root / "config.json")
    generation = root / "generation_config.json"
    generation_config = _read_json(generation) if generation.is_file() else None
    return ModelArchConfig.from_hf_config(config, generation_config)


_HALF_DTYPE_NAMES = ("bfloat16", "float16", "bf16", "fp16", "half")


def checkpoint_is_16bit(model: str | None) -> bool:
    """Whether the weights were published in 16 bits or fewer (GGUF files always count).

    HF folders: ``torch_dtype`` (or ``dtype``) in config.json; missing means float32.
    """
    path = resolve_model_path(model)
    if is_gguf(path):
        return True
    config = _read_json(Path(path) / "config.json")
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    return name in _HALF_DTYPE_NAMES


def auto_dtype(model: str | None, bf16_is_fast: bool, downcast_float32: bool = False) -> torch.dtype:
    """What ``dtype="auto"`` means, as vLLM's "auto" (the checkpoint's precision): bfloat16 for a
    16-bit or quantized checkpoint where the kernel plan multiplies bf16 fast (bf16 units, or
    pagellm's AVX2 GEMM), and for a float32 one too with ``downcast_float32`` (GPUs, where vLLM
    also runs float32 checkpoints in 16 bits); float32 for everything else (emulated bf16 is
    slower than float32)."""
    if not bf16_is_fast:
        return torch.float32
    return torch.bfloat16 if downcast_float32 or checkpoint_is_16bit(model) else torch.float32


def has_quantized_gguf_weights(model: str | None) -> bool:
    """Whether the checkpoint is a GGUF file with quantized decoder weights: blocks the integer
    GEMM takes as they are (``model.gguf_blocks``), or other block types (Q2_K, Q3_K, ...) it
    takes re-quantized to int8 blocks."""
    path = resolve_model_path(model)
    return is_gguf(path) and has_quantized_linears(open_gguf(path))


def requested_weights(config: ModelConfig) -> WeightRequest:
    """How ``config.quantization`` asks for the linears' weights (see ``QUANTIZATION_CHOICES``):
    auto asks for a GGUF file's blocks, not required (the plan keeps them unless the dtype is
    float32: the exact reference path)."""
    choice = config.quantization
    if choice == "none":
        return WeightRequest("dense", False)
    copy_bytes = 2 * load_arch_config(config.model).linear_weight_count()  # a bf16 copy (AMX plans)
    if choice == "int8":
        return WeightRequest("int8", True, copy_bytes)
    quantized_file = has_quantized_gguf_weights(config.model)
    if choice == "gguf":
        if not quantized_file:
            raise ValueError("quantization 'gguf' needs a GGUF checkpoint with quantized decoder weights")
        return WeightRequest("gguf", True, copy_bytes)
    # auto: the plan drops it where the dtype (explicit or auto) is float32.
    return WeightRequest("gguf", False, copy_bytes) if quantized_file else WeightRequest("dense", False)


def load_arch_config(model: str | None) -> ModelArchConfig:
    """The model's shape without touching weights (used first, to size the KV cache).

    Validates everything that would make the load fail later (unsupported architecture,
    sliding window, rope type, pickle-only folder), so the engine fails fast.
    """
    path = resolve_model_path(model)
    if is_gguf(path):
        arch = arch_config_from_gguf(open_gguf(path))
    else:
        arch = _hf_arch_config(path)
        safetensors_files(path)
    validate_arch_config(arch)
    return arch


def _iter_safetensors(files: list[Path], keep: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` from each shard without loading a whole shard at once (only
    the tensors ``keep`` names: a pipeline stage never reads another stage's). The shard is
    opened again for each tensor: an open shard's mapping keeps every page read through it in
    this process's memory (a whole shard, up to 5 GB, by its last tensor); a 1B bf16 model's
    peak RSS at start-up went 4.48 -> 4.13 GB (benchmarks/NOTES.md, 59)."""
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            names = [name for name in shard.keys() if keep(name)]
        for name in names:
            with safe_open(str(file), framework="pt") as shard:
                tensor = shard.get_tensor(name)
            yield name, tensor


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch ops on one thread inside the block (start-up work).

    Loading is a long series of memory-bound ops. With two OpenMP threads each op waits for
    both; when another process holds a core (shared CI or dev machines), every op then waits
    for a scheduler time slice: dequantizing this model measured 8-13 s on 2 threads next to a
    busy process versus 0.3 s on one thread (and no slower on one thread when idle).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)


@contextlib.contextmanager
def _no_param_init(dtype: torch.dtype) -> Iterator[None]:
    """Build modules with uninitialized parameters of ``dtype`` (every weight is loaded after).

    Cheaper than building on the meta device and calling ``to_empty``: the first meta-device
    construction in a process costs about a second (lazy set-up of meta kernels), and random
    init of 135M parameters costs seconds more.
    """
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS if hasattr(torch.nn.init, name)}
    previous_dtype = torch.get_default_dtype()

    def skip(tensor, *args, **kwargs):
        return tensor

    try:
        for name in saved:
            setattr(torch.nn.init, name, skip)
        torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_dtype(previous_dtype)
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _empty_model(
    arch: ModelArchConfig, attn_backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
    plan: KernelPlan | None, tp: TensorParallel | None = None, pp: PipelineStage | None = None, mtp: bool = False,
) -> LlamaForCausalLM:
    """Allocate the model in ``dtype`` on ``device`` without paying for random init (under
    tensor parallelism: this rank's share of each layer; under pipeline parallelism: this
    stage's layers)."""
    model_class = validate_arch_config(arch)
    if device.type == "cpu":
        with _no_param_init(dtype):
            model = model_class(arch, attn_backend, plan, tp, pp, mtp)
        model.tie_weights()
        return model
    with torch.device("meta"):
        model = model_class(arch, attn_backend, plan, tp, pp, mtp)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty may replace the shared Parameter objects
    return model


def load_model(
    model: str | None,
    dtype: torch.dtype,
    attn_backend: AttentionBackend,
    device: torch.device = torch.device("cpu"),
    plan: KernelPlan | None = None,
    parallel: ParallelRank | None = None,
    packs: PackedWeightsCache | None = None,
    mtp: bool = False,
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Build the model with its weights in ``dtype`` on ``device``, in eval mode, no grads,
    with the kernels ``plan`` names (None: PyTorch everywhere); ``parallel``: only this rank's
    share of each layer and its pipeline stage's layers, read from the checkpoint alone (the
    whole arch is returned); ``packs``: a GGUF file's packed weights kept between starts;
    ``mtp``: with the checkpoint's multi-token-prediction layer (``model/mtp.py``)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(map(str, SUPPORTED_DTYPES))}")
    path = resolve_model_path(model)
    with single_threaded():
        reader = open_gguf(path) if is_gguf(path) else None
        arch = arch_config_from_gguf(reader) if reader is not None else _hf_arch_config(path)
        tp = parallel.tp if parallel is not None else None
        pp = parallel.stage(arch.num_hidden_layers) if parallel is not None else None
        if mtp:
            if reader is not None:
                raise ValueError("speculative method 'mtp' reads the multi-token prediction layer from a safetensors "
                                 "checkpoint; GGUF files' (nextn) layers are not supported yet")  # fmt: skip
            mtp_layer_count(arch.architecture, text_model_config(_read_json(Path(path) / "config.json")))
        net = _empty_model(arch, attn_backend, dtype, device, plan, tp, pp, mtp)
        if reader is not None:
            keep_quantized = plan is not None and plan.weights == "gguf"
            weights = iter_gguf_weights(reader, arch, dtype, keep_float32=True, keep_quantized=keep_quantized,
                                        keep=net.holds_weight, packs=packs)  # fmt: skip
        else:
            # gpt-oss's MXFP4 experts come as blocks and scales: dequantized as each pair arrives.
            weights = join_mxfp4_pairs(_iter_safetensors(safetensors_files(path), keep=net.holds_weight))
        try:
            net.load_weights(weights)
        except BaseException:
            if packs is not None:
                packs.abandon()
            raise
        if packs is not None:
            packs.finish()
    net.requires_grad_(False)
    return net.eval(), arch


def load_vision_spec(model: str | None) -> VisionSpec | None:
    """The vision side of a vision-language checkpoint whose images pagellm takes; None for a
    text model (a GGUF file: its vision tower, if any, is a separate file not read yet)."""
    path = resolve_model_path(model)
    if is_gguf(path):
        return None
    return VisionSpec.from_hf_config(_read_json(Path(path) / "config.json"))


def load_vision_encoder(
    model: str | None, dtype: torch.dtype, device: torch.device, kernels: KernelLibrary | None = None
) -> Idefics3Vision | None:
    """The checkpoint's vision encoder and connector in ``dtype`` on ``device`` (None: a text
    model), on pagellm's CPU ``kernels`` where given."""
    spec = load_vision_spec(model)
    if spec is None:
        return None
    path = resolve_model_path(model)
    with single_threaded():
        encoder = Idefics3Vision(spec, kernels).to(dtype)
        encoder.load(_iter_safetensors(safetensors_files(path), keep=Idefics3Vision.holds))
    encoder.requires_grad_(False)
    return encoder.to(device).eval()
