"""Tensors and the device: KV cache tensors, input building, forward and sampling."""
