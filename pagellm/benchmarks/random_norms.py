"""Random weights that show a mis-mapped tensor: norm weights and biases off their initial values."""

from __future__ import annotations

import torch


def randomize_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights around 1 and biases around 0 instead of HF's exact 1 and 0, so that a
    mis-mapped norm weight or bias changes the output; a Mamba-2 layer's decays slow (HF's
    initial ones forget a token within a few, so a state carried wrongly would hardly show)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".D"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif name.endswith(".A_log"):  # decay rates exp(dt * A), A in [-0.2, -0.01] ...
                param.copy_(torch.log(torch.empty_like(param).uniform_(0.01, 0.2)))
            elif name.endswith(".dt_bias"):  # ... with time steps dt about softplus(-2) = 0.13
                param.copy_(torch.empty_like(param).uniform_(-3.0, -1.0))
