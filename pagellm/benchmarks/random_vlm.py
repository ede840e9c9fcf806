"""Random-weight vision-language checkpoints of real shapes (Idefics3 / SmolVLM), written as a
Hub folder is: weights, config, the tokenizer with the family's image tokens, the processor.

``python -m pagellm.benchmarks.random_vlm --shape smolvlm-256m OUT`` writes one: what the
vision benchmark (``benchmarks/vision_ttft.py``) measures, at exactly the cost real weights
have. The tests write the ``tiny`` shape.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch

from pagellm.benchmarks.random_norms import randomize_norms_and_biases

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)
]
# name -> (text config, vision config, scale_factor, the processor's longest edges: image, tile)
VLM_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                    patch_size=4),
        scale_factor=2, longest_edge=96, tile=32,
    ),  # fmt: skip
    # SmolVLM-256M-Instruct: SmolLM2-135M's text model, a 12-layer SigLIP over 512-pixel tiles.
    "smolvlm-256m": dict(
        text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0),
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=512, patch_size=16),
        scale_factor=4, longest_edge=2048, tile=512,
    ),  # fmt: skip
}


def write_random_idefics3(folder: str | Path, tokenizer: Any, shape: str = "tiny", dtype: torch.dtype = torch.float32,
                          seed: int = 0) -> str:  # fmt: skip
    """Save a random-weight Idefics3 checkpoint of ``shape`` with ``tokenizer`` (the family's
    image tokens added) and its processor into ``folder``; returns the folder."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    spec = VLM_SHAPES[shape]
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    text = LlamaConfig(**spec["text"], **ids, tie_word_embeddings=False)
    config = Idefics3Config(text_config=text.to_dict(), vision_config=spec["vision"], scale_factor=spec["scale_factor"],
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)  # fmt: skip
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    randomize_norms_and_biases(model)
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    images = Idefics3ImageProcessorPil(size={"longest_edge": spec["longest_edge"]},
                                       max_image_size={"longest_edge": spec["tile"]})  # fmt: skip
    tokens_per_tile = (spec["tile"] // spec["vision"]["patch_size"]) ** 2 // spec["scale_factor"] ** 2
    Idefics3Processor(images, tokenizer, image_seq_len=tokens_per_tile).save_pretrained(folder)
    return str(folder)


def random_image(width: int, height: int, seed: int) -> Any:
    """A PIL RGB image of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--shape", choices=sorted(VLM_SHAPES), default="smolvlm-256m")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    from pagellm.model.default_model import default_model_path
    from pagellm.model.tokenizer import load_tokenizer

    Path(args.folder).mkdir(parents=True, exist_ok=True)
    write_random_idefics3(args.folder, load_tokenizer(default_model_path()), args.shape, getattr(torch, args.dtype))
    print(args.folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
