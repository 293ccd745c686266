"""Tiny seeded Hugging Face checkpoints and the `transformers` reference the engine must match.

One checkpoint per supported family, each switching on the features its family brings:

    arch     layers  head_dim  feature under test
    llama    3       16        rope_parameters type "llama3" (all three frequency bands hit)
    qwen2    3       16        q/k/v bias (random, not zero)
    qwen3    2       32        q/k RMSNorm, tied embeddings, head_dim != hidden / heads
    mistral  2       16        sliding_window 48 (shorter than most test histories)
    gemma3   3       16        (1 + w) norms, four per layer, q/k norm, embeddings x sqrt(hidden),
                               gelu-tanh MLP, query_pre_attn_scalar 24, final logit softcap;
                               layers sliding (window 20, rope theta 1e4), sliding, global
                               (theta 1e6, linear factor 4)
    phi3     2       16        checkpoint's fused qkv_proj / gate_up_proj, partial rotary 0.75
                               (12 of 16 dims), LongRoPE (attention factor from max 1024 over
                               original 512; histories stay under 512, so the short factors),
                               sliding_window 48 on every layer
    qwen3_moe 3      16        top-4 of 16 experts (intermediate 32), renormalised; layer 1 dense
                               (mlp_only_layers); routing ties: experts 2j and 2j + 1 (j < 4)
                               share their router row in every layer, so their logits tie exactly
                               and torch.topk's tie order picks between them, in HF as here
    gpt_oss   3      16        sliding (window 20), full, sliding; top-4 of 8 experts (intermediate
                               32) by raw logit, router rows and biases tied in pairs as qwen3_moe's;
                               clamped SwiGLU with limit 2 (gpt-oss's 7 would rarely clamp here),
                               expert biases, attention biases and sinks; YaRN (gpt-oss's: factor
                               32 over 4096, so of the 8 frequencies some are kept, some blended
                               and some divided)

All share vocab 512, hidden 64, 4 query heads over 2 KV heads (GQA), intermediate 128,
max_position_embeddings 1024, float32. Weights use initializer_range 0.2 (HF's default 0.02 gives
logits so flat that greedy decoding meets near-ties): logits have std ~1.6 and, over the golden
test's 3,123 greedy steps, a median top-1/top-2 gap of ~0.36, 99.7% of gaps above 1e-3 and the
smallest 1.9e-4, against ~1.6e-5 between HF's own attention paths. RMSNorm weights and biases are
perturbed away from their HF init (ones, or Gemma's zeros; zeros) so that a swapped or missing
norm/bias shows.

The directory also holds a byte-level BPE tokenizer with exactly 512 tokens (every id decodes to
text), tokenizer_config.json and generation_config.json.
"""

from __future__ import annotations

import functools
import random
import threading
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch

EVERY_TENSOR_USED = pytest.mark.filterwarnings("error:.*does not use:UserWarning")
"""For modules of checkpoint fixtures: a tensor the loader reports unused is the fixture's bug or
the loader's (a false report), an error there."""

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "gpt_oss")
VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EOS_ID = 0
SEED = 1234

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=EOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=None,  # a pad id would zero that embedding row at init
    tie_word_embeddings=False,
    dtype="float32",
)

ARCH_CONFIGS: dict[str, dict] = {
    # Qwen3.5's language model: linear-attention (Gated DeltaNet) layers 0, 1 and 3, a gated full-attention
    # layer 2; 2 key heads serving 4 value heads, a convolution of width 4, a quarter of each head rotated
    # Qwen3.5-MoE's: the same layers, each MLP top-2 of 8 experts (router rows tied in pairs) beside a gated
    # shared expert
    "qwen3_5_moe": dict(
        num_hidden_layers=4,
        head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=32,
        linear_conv_kernel_dim=3,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
    # Qwen3-Next's: its interleaved input projections (2 key heads, 2 value heads each), layer 1 dense
    # (mlp_only_layers), the others top-2 of 8 experts beside a gated shared expert
    "qwen3_next": dict(
        num_hidden_layers=4,
        head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
    "qwen3_5": dict(
        num_hidden_layers=4,
        head_dim=32,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
    ),
    "llama": dict(
        num_hidden_layers=3,
        # head_dim 16, theta 1e4: wavelengths 6..2e4 tokens, so with original 256 some are kept
        # (< 64), some smoothed (64..256) and some divided by the factor (> 256).
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=256),
    ),
    "qwen2": dict(
        num_hidden_layers=3,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        use_sliding_window=False,
    ),
    "qwen3": dict(
        num_hidden_layers=2,
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        use_sliding_window=False,
    ),
    "mistral": dict(
        num_hidden_layers=2,
        sliding_window=48,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    "ministral3": dict(  # Ministral 3's YaRN rope, its queries scaled from position 256 (llama_4_scaling_beta)
        num_hidden_layers=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                             llama_4_scaling_beta=0.1),
    ),
    "gemma3": dict(
        num_hidden_layers=3,
        head_dim=16,
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=30.0,
        sliding_window=20,  # more than one block of 16 and less than two: windows start mid-block
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1000000.0)},
        # untied: tied to embeddings scaled by sqrt(hidden), random logits favour the last token
        # so strongly that greedy output repeats it
        tie_word_embeddings=False,
    ),
    "phi3": dict(
        num_hidden_layers=2,
        original_max_position_embeddings=512,
        sliding_window=48,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
                             long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0]),
    ),
    "qwen3_moe": dict(
        num_hidden_layers=3,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "gpt_oss": dict(
        num_hidden_layers=3,
        head_dim=16,
        intermediate_size=32,  # of each expert: a multiple of 32, as MXFP4 blocks need
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        swiglu_limit=2.0,
        max_position_embeddings=131072,  # gpt-oss's: YaRN's factor 32 is this over 4096
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    ),
    # families outside ARCHS (test_family_mixtral_granite.py: not in the every-family tests)
    "mixtral": dict(
        num_hidden_layers=3,
        head_dim=16,
        intermediate_size=32,  # of each expert
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "glm4_moe": dict(  # GLM-4.5's: sigmoid routing with a correction bias and a scale, a shared expert,
        # a dense first layer, q/k/v biases, q/k norms, rotary on half of each head
        num_hidden_layers=3,
        head_dim=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        attention_bias=True,
        use_qk_norm=True,
        num_mtp_layers=0,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5),
    ),
    "smollm3": dict(  # SmolLM3's NoPE layers: every third here (no_rope_layer_interval 3), q/k/v/o biases
        num_hidden_layers=3,
        no_rope_layer_interval=3,
        attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=2000000.0),
    ),
    "exaone4": dict(  # EXAONE 4's post-norm layers: sliding (window 20, rotary), sliding, full (NoPE)
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=20,
        sliding_window_pattern=3,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "olmo2": dict(  # OLMo 2's post-norm layers, q/k norms over the whole projections
        num_hidden_layers=2,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
    ),
    "olmo3": dict(  # OLMo 3's: sliding (window 20), sliding, full, each kind its own rope
        num_hidden_layers=3,
        sliding_window=20,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=500000.0)},
    ),
    "minimax_m2": dict(  # MiniMax-M2's: whole-projection q/k norms, rotary on 8 of 16 dims, top-4 of 16
        # experts (intermediate 32) by sigmoid score + a correction bias, router rows and biases tied in pairs
        num_hidden_layers=3,
        head_dim=16,
        rotary_dim=8,
        intermediate_size=32,
        num_local_experts=16,
        num_experts_per_tok=4,
        rope_parameters=dict(rope_type="default", rope_theta=5000000.0),
    ),
    "seed_oss": dict(  # Seed-OSS's q/k/v biases without an o_proj bias
        num_hidden_layers=2,
        attention_bias=True,
        attention_out_bias=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0),
    ),
    "granite": dict(
        num_hidden_layers=3,
        embedding_multiplier=3.0,
        attention_multiplier=0.09,
        residual_multiplier=0.6,
        logits_scaling=2.5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}

ODD_SHAPES: dict[str, dict] = {
    "llama": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=12, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=1),  # head_dim 8, MQA
    "qwen3": dict(num_attention_heads=3, num_key_value_heads=1, head_dim=24, tie_word_embeddings=False),
    "mistral": dict(num_key_value_heads=4, head_dim=12, sliding_window=12),  # MHA; window < a block
    "gemma3": dict(num_key_value_heads=1, head_dim=24, sliding_window=10, query_pre_attn_scalar=32),
    "phi3": dict(num_key_value_heads=1, sliding_window=7),
    "qwen3_moe": dict(num_key_value_heads=1, head_dim=12, num_experts_per_tok=3, norm_topk_prob=False),
    "gpt_oss": dict(num_attention_heads=8, num_key_value_heads=1, head_dim=24, sliding_window=8,
                    num_experts_per_tok=2),
}
"""Per family, config overrides unlike ARCH_CONFIGS' shapes: head_dim not a power of two (8, 12,
24) or not hidden / heads, one KV head or as many as query heads, GQA ratios 3, 5 and 8, windows
shorter than a 16-token block, tied embeddings flipped, top-k and normalisation changed."""

TIED_EXPERT_PAIRS = 4
"""MoE families: experts 2j and 2j + 1, j < TIED_EXPERT_PAIRS, share their router row (and bias)."""
_ROUTER_TENSORS = ("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")

_WORDS = {
    "subject": ["the agent", "a user", "the model", "our tool", "the planner", "my friend",
                "the server", "this script", "the cat", "every worker", "the scheduler"],
    "verb": ["reads", "writes", "calls", "returns", "parses", "sends", "fetches", "stores",
             "prints", "searches", "updates", "deletes", "checks", "opens", "closes"],
    "object": ["the file", "a message", "the weather", "some json", "the result", "a list",
               "the database", "an answer", "the report", "a number", "the cache", "the city"],
    "adverb": ["quickly", "slowly", "again", "today", "carefully", "twice", "at once", "later",
               "without asking", "every morning", "under pressure", "with great joy", "yesterday"],
    "place": ["in the kitchen", "near the river", "behind the garden", "from Tokyo", "over the bridge",
              "inside the terminal", "across the network", "beside the window"],
    "tail": [".", "!", "?", ", then stops.", " and waits.", " before lunch.", ": {\"ok\": true}",
             " (see line 42).", " in Paris.", " for 3 seconds."],
}


def synthetic_corpus(lines: int = 400, seed: int = SEED) -> list[str]:
    """A few hundred lines of seeded, loosely grammatical English."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        parts = [rng.choice(_WORDS["subject"]), rng.choice(_WORDS["verb"]), rng.choice(_WORDS["object"])]
        if rng.random() < 0.5:
            parts.append(rng.choice(_WORDS["adverb"]))
        if rng.random() < 0.3:
            parts.append(rng.choice(_WORDS["place"]))
        sentence = " ".join(parts) + rng.choice(_WORDS["tail"])
        out.append(sentence[0].upper() + sentence[1:])
    return out


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}; "
                           "make the synthetic corpus more varied")
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID
    return tok.to_str()


def make_tokenizer():
    """A `PreTrainedTokenizerFast` of exactly VOCAB_SIZE tokens, EOS id 0."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                   eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None,
                                   model_max_length=1024)


def make_config(arch: str, **config_overrides):
    from transformers import (Exaone4Config, Gemma3TextConfig, Glm4MoeConfig, GptOssConfig, GraniteConfig, LlamaConfig,
                              MiniMaxM2Config, Ministral3Config, MistralConfig, MixtralConfig, Olmo2Config, Olmo3Config,
                              Phi3Config, Qwen2Config, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config,
                              Qwen3MoeConfig, Qwen3NextConfig, SeedOssConfig, SmolLM3Config)

    kinds = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
             "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "qwen3_moe": Qwen3MoeConfig, "gpt_oss": GptOssConfig,
             "mixtral": MixtralConfig, "granite": GraniteConfig, "ministral3": Ministral3Config,
             "glm4_moe": Glm4MoeConfig, "smollm3": SmolLM3Config, "exaone4": Exaone4Config, "olmo2": Olmo2Config,
             "olmo3": Olmo3Config, "minimax_m2": MiniMaxM2Config, "seed_oss": SeedOssConfig,
             "qwen3_5": Qwen3_5TextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig, "qwen3_next": Qwen3NextConfig}
    if arch not in kinds:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(kinds)}")
    return kinds[arch](**{**_COMMON, **ARCH_CONFIGS[arch], **config_overrides})


def make_tiny_checkpoint(arch: str, path, seed: int = SEED, shard_size: str | None = None,
                         tied_experts: bool = True, **config_overrides) -> Path:
    """Write a seeded random `arch` checkpoint (safetensors), tokenizer and generation config to `path`.

    `shard_size` (e.g. "100KB") splits the weights into several files plus an index;
    `tied_experts`: MoE routers with TIED_EXPERT_PAIRS (False: none; torch.topk breaks ties one
    way on CUDA and another on the CPU, so a GPU-vs-CPU comparison needs routers without them);
    `config_overrides` replace fields of the transformers config.
    """
    return _save_seeded(make_config(arch, **config_overrides), Path(path), seed, shard_size, tied_experts)


def _save_seeded(config, path: Path, seed: int, shard_size: str | None = None, tied_experts: bool = True) -> Path:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    image_text = config.model_type in IMAGE_TEXT_TYPES  # (as `_hf_model` reads it)
    model = (AutoModelForImageTextToText if image_text else AutoModelForCausalLM).from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF inits RMSNorm weights to ones (Gemma's to zeros)
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):  # and biases (gpt-oss's experts' *_bias too) to zeros
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
            if name.endswith(_ROUTER_TENSORS) and tied_experts:  # a MoE router: tie pairs of experts
                p[1:2 * TIED_EXPERT_PAIRS:2] = p[0:2 * TIED_EXPERT_PAIRS:2]
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (GLM-4.5's, MiniMax-M2's: a buffer HF inits to zeros)
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
                if tied_experts:
                    b[1:2 * TIED_EXPERT_PAIRS:2] = b[0:2 * TIED_EXPERT_PAIRS:2]
    model.generation_config = GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, do_sample=False)
    if shard_size is None:
        model.save_pretrained(path, safe_serialization=True)
    else:
        model.save_pretrained(path, safe_serialization=True, max_shard_size=shard_size)
    make_tokenizer().save_pretrained(path)
    return path


def edit_config(path, drop=(), **fields) -> None:
    """Rewrite path/config.json: `drop` those keys, set `fields` (as a released config.json has them)."""
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    (Path(path) / "config.json").write_text(json.dumps({**config, **fields}))


def make_chat_checkpoint(arch: str, path, template: str, special: Sequence[str] = (), added: Sequence[str] = (),
                         bos_token: str | None = None, **config_overrides) -> Path:
    """A tiny `arch` checkpoint whose tokenizer has a chat model's markup: `special` tokens (control),
    `added` ones (text to a grammar, as Qwen's <tool_call>), and `template` as its chat template. The
    vocabulary grows by their count, so the model covers every token."""
    path = Path(path)
    make_tiny_checkpoint(arch, path, vocab_size=VOCAB_SIZE + len(special) + len(added) + 2, **config_overrides)
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.add_tokens(list(added))
    if bos_token is not None:
        tokenizer.bos_token = bos_token
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


def make_tiny_gemma3_multimodal(path, seed: int = SEED) -> Path:
    """A multimodal gemma3 checkpoint (Gemma3ForConditionalGeneration) whose language model is the
    tiny gemma3 one, beside a one-layer vision tower; saved as transformers saves them (the
    language model under language_model.model.*, lm_head untied under language_model.lm_head)."""
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=make_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, boi_token_index=VOCAB_SIZE - 3,
                          eoi_token_index=VOCAB_SIZE - 2, image_token_index=VOCAB_SIZE - 1,
                          tie_word_embeddings=False)
    return _save_seeded(config, Path(path), seed)


def make_tiny_mistral3_multimodal(path, seed: int = SEED, tie_word_embeddings: bool = False) -> Path:
    """A multimodal mistral3 checkpoint (Mistral3ForConditionalGeneration: Mistral Small 3.1 / 3.2)
    whose language model is the tiny mistral one, beside a one-layer Pixtral tower; saved as
    transformers saves them. Its output head is its own, as Mistral Small's is."""
    from transformers import Mistral3Config, PixtralVisionConfig

    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=28, patch_size=14, head_dim=16)
    text = make_config("mistral", tie_word_embeddings=tie_word_embeddings).to_dict()
    config = Mistral3Config(text_config=text, vision_config=vision.to_dict(), image_token_index=VOCAB_SIZE - 1,
                            spatial_merge_size=2, tie_word_embeddings=tie_word_embeddings)
    return _save_seeded(config, Path(path), seed)


def make_tiny_qwen3_vl(path, seed: int = SEED, tie_word_embeddings: bool = False,
                       text_tie_word_embeddings: bool | None = None) -> Path:
    """A multimodal qwen3_vl checkpoint (Qwen3VLForConditionalGeneration: Qwen3-VL-2B ... 32B) whose
    language model is the tiny qwen3 one (its multimodal rope's sections over head_dim 32), beside
    a one-layer vision tower with one deepstack merger; saved as transformers saves them.
    `text_tie_word_embeddings`: the text config's own flag (transformers reads the top level's)."""
    from transformers import Qwen3VLConfig

    text_tie = tie_word_embeddings if text_tie_word_embeddings is None else text_tie_word_embeddings
    text = make_config("qwen3", tie_word_embeddings=text_tie).to_dict()
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[6, 5, 5], mrope_interleaved=True)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=VOCAB_SIZE - 1,
                           video_token_id=VOCAB_SIZE - 2, vision_start_token_id=VOCAB_SIZE - 3,
                           vision_end_token_id=VOCAB_SIZE - 4, tie_word_embeddings=tie_word_embeddings)
    return _save_seeded(config, Path(path), seed)


def make_tiny_qwen3_5_multimodal(path, seed: int = SEED, tie_word_embeddings: bool = False) -> Path:
    """A multimodal qwen3_5 checkpoint (Qwen3_5ForConditionalGeneration: every Qwen3.5 release) whose
    language model is the tiny qwen3_5 one, beside a one-layer vision tower; saved as transformers saves
    them (the language model under model.language_model.)."""
    from transformers import Qwen3_5Config

    text = make_config("qwen3_5", tie_word_embeddings=tie_word_embeddings).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, out_hidden_size=64,
                  num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=VOCAB_SIZE - 1,
                           video_token_id=VOCAB_SIZE - 2, vision_start_token_id=VOCAB_SIZE - 3,
                           vision_end_token_id=VOCAB_SIZE - 4, tie_word_embeddings=tie_word_embeddings)
    return _save_seeded(config, Path(path), seed)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> MXFP4 (blocks uint8 [..., K // 32, 16], e8m0 scales uint8 [..., K // 32]):
    each block's scale the power of two that puts its largest magnitude in [4, 8), each value
    rounded to the nearest e2m1 code; the even index in the low nibble."""
    from hibana_kernels.moe import E2M1_VALUES, MXFP4_BLOCK

    groups = w.float().unflatten(-1, (-1, MXFP4_BLOCK))
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -126))) - 2
    x = groups / torch.exp2(exponent)[..., None]
    magnitude = (x.abs()[..., None] - torch.tensor(E2M1_VALUES[:8])).abs().argmin(-1)
    codes = (magnitude | ((x < 0).long() << 3)).unflatten(-1, (MXFP4_BLOCK // 2, 2))
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)


def make_mxfp4_checkpoint(source, path) -> Path:
    """`source` (a float gpt_oss checkpoint) with its experts in MXFP4, as the released
    checkpoints hold them: gate_up_proj_blocks [E, 2I, H // 32, 16] (rows interleaved gate, up),
    down_proj_blocks [E, H, I // 32, 16], their scales, and quantization_config mxfp4."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, path = Path(source), Path(path)
    shutil.copytree(source, path)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] there
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            tensors[name] = tensor
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        "dequantize": True}  # transformers' load option (on CPU it dequantizes anyway, but asks for
    # accelerate unless told); Hibana reads the blocks and scales all the same
    (path / "config.json").write_text(json.dumps(config))
    return path


IMAGE_TEXT_TYPES = ("mistral3", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
"""Multimodal checkpoints that transformers keeps out of AutoModelForCausalLM: their
image-text-to-text class generates from text alone."""


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    # a multimodal checkpoint that transformers keeps out of AutoModelForCausalLM (Mistral 3's)
    # generates from text alone as its image-text-to-text class
    image_text = AutoConfig.from_pretrained(path).model_type in IMAGE_TEXT_TYPES
    model = (AutoModelForImageTextToText if image_text else AutoModelForCausalLM).from_pretrained(
        path, dtype=torch.float32)
    # generate() fills unset fields of a passed GenerationConfig from the model's own one, EOS
    # included, so the model's own one must not know of any EOS either.
    model.generation_config = _no_stop_config(max_new_tokens=1)
    return model.eval()


def _no_stop_config(max_new_tokens: int):
    from transformers import GenerationConfig

    # eos_token_id=None rather than min_new_tokens: min_new_tokens masks the EOS logit, so HF
    # would pick the runner-up where the engine (ignore_eos) picks EOS itself.
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                            eos_token_id=None, pad_token_id=EOS_ID, bos_token_id=EOS_ID,
                            num_beams=1, repetition_penalty=1.0,
                            output_logits=True, return_dict_in_generate=True)


@functools.lru_cache(maxsize=4096)
def _hf_greedy(path: str, token_ids: tuple[int, ...],
               max_new_tokens: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    model = _hf_model(path)
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=_no_stop_config(max_new_tokens))
    new = tuple(int(t) for t in out.sequences[0, len(token_ids):])
    assert len(new) == max_new_tokens, f"HF stopped early: {len(new)} of {max_new_tokens}"
    gaps = []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return new, tuple(gaps)


def hf_greedy(path, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by `transformers` generate: exactly max_new_tokens new ids, EOS ignored."""
    return list(_hf_greedy(str(path), tuple(int(t) for t in token_ids), int(max_new_tokens))[0])


def hf_greedy_gaps(path, token_ids: Sequence[int], max_new_tokens: int) -> list[float]:
    """Top-1 minus top-2 logit at each greedy step (how close HF came to a tie)."""
    return list(_hf_greedy(str(path), tuple(int(t) for t in token_ids), int(max_new_tokens))[1])


def mismatch_report(path, history: Sequence[int], got: Sequence[int], want: Sequence[int]) -> str:
    """A failure message that says where the engine left HF and how close HF was to a tie there."""
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    gaps = hf_greedy_gaps(path, history, len(want))
    gap = f"{gaps[first]:.3g}" if first < len(gaps) else "n/a"
    return (f"history of {len(history)} tokens: engine left HF at generated token {first} "
            f"(HF top1-top2 logit gap there {gap})\n engine: {list(got)}\n     hf: {list(want)}")


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """n token ids drawn uniformly from the whole vocabulary (EOS and pad included)."""
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def agent_turn_plan(seed: int, turns: int = 4) -> list[tuple[list[int], int]]:
    """Per turn: (10-60 new history tokens, 16-32 tokens to generate), seeded."""
    rng = random.Random(seed)
    return [(random_tokens(rng, rng.randint(10, 60)), rng.randint(16, 32)) for _ in range(turns)]


# --- comparing the engine with the reference --------------------------------------------------

TIE_TOL = 0.0
"""A differing greedy token is accepted only where HF's logit for it is within TIE_TOL of HF's
maximum. Zero: only an exact tie passes. (HF's own sdpa / eager / cached paths differ by up to
~1.6e-5 here, and the smallest top-2 gap on the golden histories is 1.9e-4, so a flip would mean
a real bug, not noise.)"""


def hf_next_logits(path, token_ids: Sequence[int]) -> torch.Tensor:
    """HF's logits for the token after `token_ids` (a full forward, no cache)."""
    model = _hf_model(str(path))
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)], dtype=torch.long)).logits[0, -1].float()


def run_agents_at_once(run_agent: Callable[[int], None], agents: int) -> None:
    """run_agent(0), ..., run_agent(agents - 1), each on its own thread, all at once (the engine
    batches their steps); each thread is given four minutes."""
    threads = [threading.Thread(target=run_agent, args=(a,)) for a in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)


def greedy_turns_at_once(engine, prefix: str, plans: Sequence[Sequence[tuple[Sequence[int], int]]]) -> list[list]:
    """Each plan an agent on state f"{prefix}-{i}", all at once (`run_agents_at_once`): per turn its
    new tokens appended to the history, then that many tokens generated greedily past any EOS on
    it, the state keeping what it held. Per agent its turns as (history, Completion)."""
    from hibana_core import SamplingParams

    results: dict[int, list] = {}

    def run_agent(agent: int) -> None:
        h, history, turns = engine.open_state(f"{prefix}-{agent}"), [], []
        for new, n in plans[agent]:
            history = history + list(new)
            c = h.generate(SamplingParams(max_tokens=n, ignore_eos=True), prompt=history)
            turns.append((history, c))
            history = history + list(c.token_ids)
        results[agent] = turns

    run_agents_at_once(run_agent, len(plans))
    assert sorted(results) == list(range(len(plans)))
    return [results[agent] for agent in range(len(plans))]


def three_agents_three_turns(engine, path, prefix: str, seed: int) -> None:
    """3 agents at once, 3 turns each with retention (`agent_turn_plan`); every generation
    transformers' greedy on its history, and the later turns reuse the retained KV."""
    agents = greedy_turns_at_once(engine, prefix, [agent_turn_plan(seed + a, turns=3) for a in range(3)])
    for turns in agents:
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    assert engine.stats().prompt_tokens_reused > 0, "later turns must reuse the retained KV"


def assert_greedy_matches(path, history: Sequence[int], got: Sequence[int]) -> None:
    """`got` must be HF's greedy continuation of `history`, token for token.

    Where they differ, the engine's token must tie HF's (within TIE_TOL); the check then goes on
    from the engine's own tokens, so every later token is still held to HF.
    """
    import warnings

    prefix, rest = [int(t) for t in history], [int(t) for t in got]
    while rest:
        want = hf_greedy(path, prefix, len(rest))
        first = next((i for i, (a, b) in enumerate(zip(rest, want)) if a != b), None)
        if first is None:
            return
        logits = hf_next_logits(path, prefix + rest[:first])
        shortfall = float(logits.max() - logits[rest[first]])
        if shortfall > TIE_TOL:
            raise AssertionError(mismatch_report(path, history, got, hf_greedy(path, history, len(got))))
        warnings.warn(f"accepted a float32 tie at generated token {len(prefix) - len(history) + first} "
                      f"(HF logit shortfall {shortfall:.2g})")
        prefix += rest[:first + 1]
        rest = rest[first + 1:]


# --- engine-side helpers (the engine is imported lazily, so collection works without it) ------

TEST_NUM_BLOCKS = 256
"""Enough for every test (4 agents x ~370 tokens, forks, an 1100-token history) without the CPU
backend's automatic sizing, which may reserve up to 2 GiB per engine."""


def open_engine(path, **overrides):
    """`Engine.from_pretrained(path, device="cpu", dtype="float32", block_size=16, ...)`."""
    from hibana_core import Engine

    options = dict(device="cpu", dtype="float32", block_size=16, num_blocks=TEST_NUM_BLOCKS,
                   progress=False)
    return Engine.from_pretrained(str(path), **{**options, **overrides})
