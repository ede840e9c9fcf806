"""LoRA adapters as PEFT writes them (``adapter_config.json`` + ``adapter_model.safetensors``)
or as llama.cpp's converter does (a GGUF file: ``lora_gguf``), checked against the served model
before any request runs with one.

An adapter adds ``scaling * B @ A`` to some of each layer's projections: ``A`` is ``[r, in]``,
``B`` is ``[out, r]``, ``scaling`` is ``lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``).
pagellm applies them to the attention's q/k/v/o and the dense MLP's gate/up/down projections;
anything else an adapter holds (embeddings, the LM head, experts, ``modules_to_save``, DoRA,
biases) is refused by name, as is a pickle file (``adapter_model.bin``), never loaded.

:func:`inspect_adapter` reads the config and the safetensors header only (shapes, no weights):
the engine calls it at the boundary, so a bad adapter is the request's error. The worker then
reads the weights with :func:`read_adapter`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open

from pagellm.distributed.tensor_parallel import COLUMN_PARALLEL, TensorParallel
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.layer_spec import LayerSpec, layer_specs
from pagellm.model.lora_gguf import GGUFLoRA
from pagellm.model.weight_names import checkpoint_parts, llama_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 1 << 20
FLOAT_DTYPES = ("F32", "F16", "BF16")  # safetensors' names of the dtypes an adapter's weights may have
# The projections an adapter may target, each the part of one of the model's fused linears.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "g_proj"))
# Each of a layer's linears as the model fuses them, and the targets that are its parts (in row
# order; ``fused_parts``: with Qwen3.5's output gate, whose rows its q_proj's adapter splits like
# its weight, ``g_proj`` after v).
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# Checkpoints that fuse projections in one tensor (Phi-3, Phi-4-mini) name them so in adapters
# too: one A for all the parts, B's rows the parts' in order (read as each part's pair).
FUSED_ADAPTER_TARGETS = {fused: parts for fused, parts in FUSED_TARGETS.items() if len(parts) > 1}
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d{1,6})\.(?:self_attn|mlp)\."
    r"(?P<target>q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj)"
    r"\.lora_(?P<part>[AB])\.weight$"
)
# adapter_config.json keys that change what the weights mean, refused unless at these values.
_UNSUPPORTED = {
    "use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
    "modules_to_save": (None, []), "alpha_pattern": (None, {}), "lora_bias": (False, None),
    "target_parameters": (None, []), "layer_replication": (None, []),
}


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served with this model (the message says why)."""


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter's files say, checked against the model: the projections it adds to
    (``(layer, target)`` -> rank) and each one's scaling."""

    path: str
    ranks: dict[tuple[int, str], int]
    scaling: dict[tuple[int, str], float]
    # The file's name of each tensor named otherwise by the model's family (LFM2's
    # ``feed_forward.w1``), by its Llama-family name (``mlp.gate_proj``); others as they are.
    file_names: dict[str, str] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(self.ranks.values())


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights: ``(layer, target)`` -> (``A`` [r, in], ``B`` [out, r] times its scaling)."""

    info: AdapterInfo
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


# Qwen3.5's output gate: its rows of q_proj (split like the weight) add to the fused q/k/v after v.
OUTPUT_GATE_PART = "g_proj"
# The fused linear each part belongs to.
FUSED_OF = {part: fused for fused, parts in FUSED_TARGETS.items() for part in parts} | {OUTPUT_GATE_PART: "qkv_proj"}


def fused_parts(spec: LayerSpec, fused: str) -> tuple[str, ...]:
    """The parts of ``spec``'s fused linear ``fused`` an adapter adds to, in row order."""
    parts = FUSED_TARGETS[fused]
    return (*parts, OUTPUT_GATE_PART) if fused == FUSED_OF[OUTPUT_GATE_PART] and spec.output_gate else parts


def target_shape(spec: LayerSpec, target: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of one layer's projection (a whole model's, not a rank's),
    or of projections fused in one tensor (``FUSED_ADAPTER_TARGETS``)."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    if target in FUSED_ADAPTER_TARGETS:
        return hidden, sum(target_shape(spec, part)[1] for part in FUSED_ADAPTER_TARGETS[target])
    return {
        "q_proj": (hidden, spec.q_size), "k_proj": (hidden, spec.kv_size), "v_proj": (hidden, spec.kv_size),
        "o_proj": (spec.q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden), "g_proj": (hidden, spec.q_size),
    }[target]  # fmt: skip


def inspect_adapter(path: str, arch: ModelArchConfig, max_rank: int) -> AdapterInfo:
    """The adapter in folder ``path`` (or GGUF file), checked against ``arch`` and ``max_rank``
    from its config and tensor shapes (no weight is read); raises :class:`LoRAAdapterError`
    naming the problem."""
    if os.path.isfile(path):
        gguf = _gguf(path)
        ranks = _check_shapes(path, gguf.shapes, layer_specs(arch), arch, max_rank)
        return AdapterInfo(path, ranks, {key: gguf.scaling(r) for key, r in ranks.items()})
    config = _read_config(path)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        pickled = [name for name in PICKLE_FILES if os.path.isfile(os.path.join(path, name))]
        if pickled:
            raise LoRAAdapterError(f"adapter {path!r} holds {pickled[0]}, a pickle file, which pagellm never loads: "
                                   f"save it as {WEIGHTS_FILE} (PEFT's save_pretrained(safe_serialization=True))")  # fmt: skip
        raise LoRAAdapterError(f"adapter {path!r} has no {WEIGHTS_FILE}")
    try:
        with safe_open(weights, framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
            dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAAdapterError(f"adapter {path!r}: {WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    odd = sorted({dtype for dtype in dtypes.values() if dtype not in FLOAT_DTYPES})
    if odd:
        raise LoRAAdapterError(f"adapter {path!r} holds {', '.join(odd)} tensors; LoRA weights are {'/'.join(FLOAT_DTYPES)}")
    file_names = _llama_names(path, arch, list(shapes))
    shapes = {name: shapes[file_name] for name, file_name in file_names.items()}
    ranks = _check_shapes(path, shapes, layer_specs(arch), arch, max_rank)
    alpha, rslora = config.get("lora_alpha", 8), config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAAdapterError(f"adapter {path!r}: use_rslora must be true or false, got {rslora!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = {key: alpha / (math.sqrt(r) if rslora else r) for key, r in ranks.items()}
    return AdapterInfo(path, ranks, scaling, {name: f for name, f in file_names.items() if name != f})


_PEFT_PREFIX = "base_model.model."


def _llama_names(path: str, arch: ModelArchConfig, keys: list[str]) -> dict[str, str]:
    """Each tensor's name with the model's module path by the Llama-family names (as the
    checkpoint's own names are mapped, ``weight_names.llama_name``) -> its name in the file."""
    names: dict[str, str] = {}
    for key in keys:
        name = _PEFT_PREFIX + llama_name(arch, key[len(_PEFT_PREFIX) :]) if key.startswith(_PEFT_PREFIX) else key
        if name in names:
            raise LoRAAdapterError(f"adapter {path!r} holds {names[name]!r} and {key!r}, one projection twice")
        names[name] = key
    return names


def read_adapter(path: str, arch: ModelArchConfig, max_rank: int) -> LoRAAdapter:
    """The adapter's weights, checked as :func:`inspect_adapter` checks them, each ``B`` scaled."""
    info = inspect_adapter(path, arch, max_rank)
    if os.path.isfile(path):
        heads = {"q_proj": arch.num_attention_heads, "k_proj": arch.num_key_value_heads}
        return _scaled(info, _gguf(path).reader_of(heads), arch)
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        return _scaled(info, lambda key: f.get_tensor(info.file_names.get(key, key)).float(), arch)


def _scaled(info: AdapterInfo, read: Callable[[str], torch.Tensor], arch: ModelArchConfig) -> LoRAAdapter:
    """Each pair ``info`` names read by its PEFT name, float32, ``B`` times its scaling. ``B``'s
    rows are the projection's output rows, so it goes through the mapping the checkpoint's weight
    of that projection goes through (``weight_names.checkpoint_parts``: q/k rows in rotate-half's
    order where the family's rotary is interleaved, a fused projection split into its parts,
    each part taking the same ``A``)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), scale in info.scaling.items():
        module = f"model.layers.{layer}.{'self_attn' if target in ATTENTION_TARGETS else 'mlp'}.{target}"
        a, b = (read(f"{_PEFT_PREFIX}{module}.lora_{part}.weight").float() for part in "AB")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(f"adapter {info.path!r}: {module} holds infinities or NaNs")
        for name, b_part in checkpoint_parts(arch, f"{module}.weight", b * scale):
            weights[(layer, name.split(".")[-2])] = (a, b_part.contiguous())  # type: ignore[union-attr]
    return LoRAAdapter(info, weights)


def _gguf(path: str) -> GGUFLoRA:
    """The GGUF LoRA file at ``path`` (a pickle file named as one is still refused)."""
    if os.path.basename(path) in PICKLE_FILES or path.endswith((".bin", ".pt", ".pth")):
        raise LoRAAdapterError(f"adapter {path!r} is a pickle file, which pagellm never loads: give a PEFT folder "
                               f"({WEIGHTS_FILE}) or a GGUF LoRA file")  # fmt: skip
    try:
        return GGUFLoRA(path)
    except ValueError as exc:
        raise LoRAAdapterError(f"adapter {exc}") from None


def rank_share(adapter: LoRAAdapter, tp: TensorParallel) -> LoRAAdapter:
    """A tensor-parallel rank's part of ``adapter``, cut as its projections' weights are: ``B``'s
    rows of a projection whose output rows are split (q/k/v, gate/up; ``A`` whole), ``A``'s
    input columns of one whose inputs are (o, down; ``B`` whole: the ranks' products are summed
    by the projection's all-reduce)."""
    weights = {}
    for (layer, target), (a, b) in adapter.weights.items():
        name = f"model.layers.{layer}.{'self_attn' if target in ATTENTION_TARGETS else 'mlp'}.{target}.weight"
        if target in COLUMN_PARALLEL:
            b = tp.share(name, b)  # type: ignore[assignment]
        else:
            a = tp.share(name, a)  # type: ignore[assignment]
        weights[(layer, target)] = (a.contiguous(), b.contiguous())
    return LoRAAdapter(adapter.info, weights)


def _read_config(path: str) -> dict[str, object]:
    """adapter_config.json, with what pagellm cannot apply refused by name."""
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"adapter {path!r} is not a folder (a PEFT adapter: {CONFIG_FILE} and {WEIGHTS_FILE}) "
                               "nor a GGUF LoRA file")  # fmt: skip
    file = os.path.join(path, CONFIG_FILE)
    try:
        if os.path.getsize(file) > MAX_CONFIG_BYTES:
            raise LoRAAdapterError(f"adapter {path!r}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
        with open(file, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError:
        raise LoRAAdapterError(f"adapter {path!r} has no readable {CONFIG_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise LoRAAdapterError(f"adapter {path!r}: {CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"adapter {path!r}: {CONFIG_FILE} must hold a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAAdapterError(f"adapter {path!r} is a {kind!r} adapter; pagellm serves LoRA adapters")
    for key, allowed in _UNSUPPORTED.items():
        if key in config and config[key] not in allowed:
            raise LoRAAdapterError(f"adapter {path!r} sets {key}={config[key]!r}, which pagellm does not support")
    return config


def _check_shapes(
    path: str, shapes: dict[str, tuple[int, ...]], specs: tuple[LayerSpec, ...], arch: ModelArchConfig, max_rank: int
) -> dict[tuple[int, str], int]:
    """Each projection's rank, every tensor matched to a projection of ``arch`` with its shape."""
    found: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = _TENSOR.match(key)
        if match is None:
            raise LoRAAdapterError(f"adapter {path!r} holds {key!r}: pagellm applies adapters to the "
                                   f"{'/'.join(t.removesuffix('_proj') for t in TARGETS)} projections of "
                                   "each layer only (or fused qkv_proj / gate_up_proj)")  # fmt: skip
        layer, target = int(match["layer"]), match["target"]
        if layer >= len(specs):
            raise LoRAAdapterError(f"adapter {path!r} holds {key!r}, but {arch.architecture} has {len(specs)} layers")
        found.setdefault((layer, target), {})[match["part"]] = shape
    if not found:
        raise LoRAAdapterError(f"adapter {path!r} holds no LoRA weights")
    ranks: dict[tuple[int, str], int] = {}
    for (layer, target), parts in sorted(found.items()):
        spec, name = specs[layer], f"layer {layer}'s {target}"
        if set(parts) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {path!r}: {name} has lora_{''.join(parts)} without its pair")
        twice = [part for part in FUSED_ADAPTER_TARGETS.get(target, ()) if (layer, part) in found]
        if twice:
            raise LoRAAdapterError(f"adapter {path!r} targets layer {layer}'s {target} and its part {twice[0]} both")
        if target in ATTENTION_TARGETS and (spec.recurrent or spec.mla is not None):
            what = "has no attention" if spec.recurrent else "is multi-head latent attention (MLA), not supported yet"
            raise LoRAAdapterError(f"adapter {path!r} targets {name}, but that layer of {arch.architecture} {what}")
        if target == "qkv_proj" and spec.output_gate:
            raise LoRAAdapterError(f"adapter {path!r} targets {name}: {arch.architecture} has separate q/k/v "
                                   "projections (its q_proj makes each head's query and output gate)")  # fmt: skip
        if target not in ATTENTION_TARGETS and spec.moe:
            raise LoRAAdapterError(f"adapter {path!r} targets {name}, but that layer is a mixture of experts "
                                   "(adapters on experts are not supported)")  # fmt: skip
        features_in, features_out = target_shape(spec, target)
        if target == "q_proj" and spec.output_gate:  # (each head's query rows, then its gate's: split on read)
            features_out *= 2
        a, b = parts["A"], parts["B"]
        if len(a) != 2 or len(b) != 2 or a[1] != features_in or b[0] != features_out or a[0] != b[1]:
            raise LoRAAdapterError(
                f"adapter {path!r}: {name} has A {list(a)} and B {list(b)}, but {arch.architecture} needs A [r, "
                f"{features_in}] and B [{features_out}, r]: the adapter was trained for another model"
            )  # fmt: skip
        if not 1 <= a[0] <= max_rank:
            raise LoRAAdapterError(f"adapter {path!r} has rank {a[0]} ({name}), above --max-lora-rank {max_rank}")
        ranks[(layer, target)] = a[0]
    return ranks
