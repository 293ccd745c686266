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
    # openai/gpt-oss-20b and -120b: layers alternating sliding (window 128) and full attention,
    # attention sinks, YaRN (factor 32 over 4096; the config's defaults), top-4 routing, experts
    # in MXFP4 as released (`mxfp4_experts`: see `_with_random_mxfp4_experts`)
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        max_position_embeddings=131072, tie_word_embeddings=False, mxfp4_experts=True),
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                         num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                         max_position_embeddings=131072, tie_word_embeddings=False, mxfp4_experts=True),
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


def chat_tokenizer() -> Any:
    """The demo model's tokenizer and chat template (hermes tool calls), which a random-weight
    preset chats with (`hibana bench serve`): its replies are garbage, but every turn is a
    well-formed chat turn, and its cost per token is the preset's."""
    from transformers import AutoTokenizer

    from hibana_core.loader import DEMO_MODEL_DIR

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def load_bench_model(name: str, device: torch.device, dtype: torch.dtype, chat: bool = False) -> BenchModel:
    """A preset (random weights), "demo", a checkpoint directory or a Hugging Face repo id.
    `chat`: a preset gets `chat_tokenizer()` (its vocabulary covers the tokenizer's ids, and the
    tokenizer's end of text is its end of sequence); the others have their own tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name in PRESETS:
        spec = dict(PRESETS[name])
        mxfp4 = spec.pop("mxfp4_experts", False)
        tokenizer = chat_tokenizer() if chat else None
        if tokenizer is not None:
            spec.update(vocab_size=max(spec["vocab_size"], len(tokenizer)), eos_token_id=tokenizer.eos_token_id)
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        with torch.device("meta" if mxfp4 else device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if mxfp4:
            model = _with_random_mxfp4_experts(model, device)
        random_weights = True
    else:
        from hibana_core.loader import resolve_checkpoint

        path = resolve_checkpoint(name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        tokenizer, random_weights = AutoTokenizer.from_pretrained(path), False
    model.eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return BenchModel(name, model, tokenizer, random_weights, weight_bytes)


class MXFP4Experts(torch.nn.Module):
    """gpt-oss experts as its MXFP4 checkpoints hold them (blocks, e8m0 scales, float biases):
    what the engine loads. Weights only: transformers' own MXFP4 experts need the Hub's Triton
    kernels, so the transformers peers cannot run a model holding these."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        e, i, h = config.num_local_experts, config.intermediate_size, config.hidden_size

        def packed(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

        self.gate_up_proj_blocks, self.gate_up_proj_scales = packed(e, 2 * i, h // 32, 16), packed(e, 2 * i, h // 32)
        self.down_proj_blocks, self.down_proj_scales = packed(e, h, i // 32, 16), packed(e, h, i // 32)
        self.gate_up_proj_bias = torch.nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj_bias = torch.nn.Parameter(torch.empty(e, h))


def _with_random_mxfp4_experts(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A gpt-oss model built on "meta" -> on `device` with MXFP4 experts, random weights (the
    released checkpoints' bytes per token without a bf16 copy of the experts: the 120B's would
    not fit one GPU). Codes uniform, scales 2^-6 (values within +-6/64), other weights N(0, 0.02),
    norms ones, biases zero; quantization_config says mxfp4, as a real checkpoint's does."""
    for layer in model.model.layers:
        with torch.device("meta"):
            layer.mlp.experts = MXFP4Experts(model.config)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == torch.uint8:
                p.fill_(127 - 6) if name.endswith("_scales") else p.random_(0, 256)
            elif "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1 or name.endswith("_bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    model.config.quantization_config = {"quant_method": "mxfp4"}
    return model
