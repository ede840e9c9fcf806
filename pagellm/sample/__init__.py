"""Token sampling: logits processing, seeded/unseeded draws and logprobs."""

from pagellm.sample.sampler import Sampler, SamplerOutput, SamplingBatch, gather_logprobs

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "gather_logprobs"]
