"""What a benchmark runs on: a checkpoint, the demo model, or an architecture preset built with
random weights on the device (speed does not depend on weight values).

Hibana and the transformers peers run on the very same weights: the peer's model is built (or
loaded) first, and the engine copies its weights (`Engine.from_hf_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960),
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen/Qwen3-30B-A3B: 48 sparse layers, top-8 of 128 experts (768 wide), no shared expert
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960),
    # google/gemma-3-12b-it's text model: 5 sliding (window 1024, theta 1e4) : 1 global layer
    # (theta 1e6, linear factor 8)
    "gemma3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                       query_pre_attn_scalar=256, sliding_window=1024, max_position_embeddings=131072,
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0}},
                       tie_word_embeddings=True),
    # microsoft/Phi-4-mini-instruct: LongRoPE over 96 of 128 head dims; its factor lists are
    # stand-ins of the right length (48), as speed does not depend on them
    "phi4-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, rms_norm_eps=1e-5,
                      max_position_embeddings=131072, original_max_position_embeddings=4096,
                      sliding_window=262144, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                       "short_factor": [1.0 + i / 48 for i in range(48)],
                                       "long_factor": [1.0 + i for i in range(48)]}),
}


@dataclass
class BenchModel:
    name: str
    hf_model: torch.nn.Module      # the transformers model the peers run
    tokenizer: Any | None
    random_weights: bool
    weight_bytes: int

    @property
    def vocab_size(self) -> int:
        return self.hf_model.config.vocab_size

    def engine(self, **overrides):
        from hibana_core import Engine

        return Engine.from_hf_model(self.hf_model, self.tokenizer, progress=False, **overrides)


def load_bench_model(name: str, device: torch.device, dtype: torch.dtype) -> BenchModel:
    """A preset (random weights), "demo", a checkpoint directory or a Hugging Face repo id."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name in PRESETS:
        spec = dict(PRESETS[name])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer, random_weights = None, True
    else:
        from hibana_core.loader import resolve_checkpoint

        path = resolve_checkpoint(name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        tokenizer, random_weights = AutoTokenizer.from_pretrained(path), False
    model.eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return BenchModel(name, model, tokenizer, random_weights, weight_bytes)
