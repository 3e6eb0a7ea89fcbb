"""What `FreeTransformerForCausalLM.generate` adds to Hugging Face's decoding loop besides the latent
plan (free_transformer.inference.latents.LatentPlan, the same decoding rule as the decoding engine's):
per-row seeded sampling (`RowSeededSampler`), with the engine's sampler (free_transformer.inference.sampling).
Hugging Face's loop stays: it is transformers' contract."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import LogitsProcessor

from ..inference.params import Sampling
from ..inference.sampling import sample_next


class RowSeededSampler(LogitsProcessor):
    """Samples the next token of row i from its counter-based key keys[i], at the position of the logits, as the
    decoding engine does, and returns scores that are 0
    at the chosen token and -inf elsewhere, so that Hugging Face's greedy
    step (argmax) takes exactly that token. It must be the last processor and generate must run with
    do_sample=False (FreeTransformerForCausalLM.generate arranges both when `seeds` is given)."""

    def __init__(self, sampling: Sampling, keys: Tensor):
        self.sampling = sampling
        self.keys = keys  # (B,) int64, counter_random.row_keys of the rows' seeds

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        # the scores are those of the last token of input_ids (B, T): position T - 1
        token = sample_next(scores, self.sampling, self.keys, input_ids.shape[1] - 1)  # (B,)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, token[:, None], 0.0)
