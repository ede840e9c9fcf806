"""Model package: architecture configs, the Llama-family model, loaders and tokenizers."""

from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import load_arch_config, load_model, resolve_model_path
from pagellm.model.registry import get_model_class, supported_architectures, validate_arch_config
from pagellm.model.tokenizer import load_tokenizer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LlamaForCausalLM",
    "ModelArchConfig",
    "default_model_path",
    "get_model_class",
    "load_arch_config",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
    "supported_architectures",
    "validate_arch_config",
]
