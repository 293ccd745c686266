"""What users run instead of Hibana, driven the way the framework integrations drive it.

- `hf_eager`: transformers `generate` with its default dynamic cache (LangChain's
  HuggingFacePipeline and LlamaIndex's HuggingFaceLLM run this).
- `hf_compiled`: `generate` with a static cache, which transformers compiles with torch.compile.
- `hf_reprefill`: `hf_eager` on the whole history every turn.
- `hf_cache_reuse`: `hf_eager` carrying its cache from turn to turn (prefills only the new tokens).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFPeer:
    def __init__(self, model: torch.nn.Module, static_cache: bool = False) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.static_cache = static_cache

    def generate(self, token_ids: list[int], max_new_tokens: int, cache: Any = None) -> tuple[list[int], float]:
        """Greedy, exactly max_new_tokens tokens; returns (new tokens, seconds)."""
        ids = torch.tensor([token_ids], device=self.device)
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)
        if self.static_cache:
            kwargs["cache_implementation"] = "static"
        if cache is not None:
            kwargs["past_key_values"] = cache
        sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode(), warnings.catch_warnings():
            # transformers 5.x renames past_key_values; the old name works across 5.x
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        sync(self.device)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)
