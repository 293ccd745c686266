"""What a benchmark runs on: a checkpoint, the demo model, or an architecture preset built with
random weights on the device (speed does not depend on weight values).

Hibana and the transformers peers run on the very same weights. A checkpoint's transformers model
is loaded on the device and the engine copies its weights (`Engine.from_hf_model`). A preset never
holds two copies on the device (qwen3-30b-a3b's 61 GB would not fit twice on one H200): its
transformers model is built on "meta" but for its small tensors, the engine loads the big ones made
on the device one at a time (`RandomWeights`, through the loader's own path: fused layouts, MXFP4
experts), and a peer gets the model on the device, with the same values, only while it runs
(`BenchModel.peer_model`, once the engines are closed).
"""

from __future__ import annotations

import gc
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

def _qwen3_5(model_type: str, **fields: Any) -> dict[str, Any]:
    """A Qwen3.5 language model's preset: what every size shares (attention heads of 256, a quarter
    of each rotated; linear-attention heads of 128 and their width-4 convolution; the 248k
    vocabulary, 262k positions), then `fields`."""
    return dict(model_type=model_type, head_dim=256, vocab_size=248320, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}, **fields)


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
    # Qwen/Qwen3.5-35B-A3B's language model: 10 x (3 Gated DeltaNet + 1 gated attention) layers, each
    # MLP top-8 of 256 experts (512 wide) beside a gated shared expert; attention 16 q / 2 kv heads of 256,
    # a quarter of each rotated; linear attention 16 q/k heads serving 32 v heads of 128
    "qwen3.5-35b-a3b": _qwen3_5("qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                                moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False),
    # Qwen/Qwen3.5-27B's language model, dense: 16 x (3 Gated DeltaNet + 1 gated attention) layers; attention
    # 24 q / 4 kv heads of 256, a quarter of each rotated; linear attention 16 q/k heads serving 48 v heads of 128
    # (54 GB of bf16 weights: an H100 holds it)
    "qwen3.5-27b": _qwen3_5("qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                            num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                            linear_num_value_heads=48, tie_word_embeddings=False),
    # Qwen/Qwen3.5-0.8B's language model (the draft model for a Qwen3.5 target: the small checkpoints
    # sharing its tokenizer): 6 x (3 Gated DeltaNet + 1 gated attention) layers; attention 8 q / 2 kv
    # heads of 256, a quarter of each rotated; linear attention 16 q/k heads, 16 v heads of 128; tied
    "qwen3.5-0.8b": _qwen3_5("qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                             num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=16,
                             linear_num_value_heads=16, tie_word_embeddings=True),
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
    hf_model: torch.nn.Module | None  # the transformers model the peers run (a preset's: see peer_model;
                                      # a checkpoint's is loaded there, for the peers alone)
    tokenizer: Any | None
    device: torch.device
    weight_bytes: int
    random: RandomWeights | None = None  # a preset's weights; None for a checkpoint
    path: Path | None = None             # a checkpoint's directory, which the engines load as it is
    config: Any = None                   # its transformers config
    dtype: torch.dtype | None = None

    @property
    def random_weights(self) -> bool:
        return self.random is not None

    @property
    def text_config(self) -> Any:
        """The model's transformers config (a multimodal one's text config, which has its vocabulary and context)."""
        return (self.config or self.hf_model.config).get_text_config()

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    def engine(self, **overrides):
        from hibana_core import Engine

        limit = getattr(self.text_config, "max_position_embeddings", None)
        if limit and (overrides.get("max_model_len") or 0) > limit:  # the workloads pad what they need;
            overrides["max_model_len"] = limit  # past the model's context a workload's own check says so
        if self.path is not None:  # the checkpoint as it is: packed layers, a surgery manifest, its own dtype
            overrides.setdefault("device", str(self.device))
            overrides.setdefault("dtype", str(self.dtype).removeprefix("torch."))
            return Engine.from_pretrained(str(self.path), progress=False, **overrides)
        return Engine.from_hf_model(self.random, self.tokenizer, progress=False, **overrides)

    @contextmanager
    def peer_model(self) -> Iterator[torch.nn.Module]:
        """The transformers model on the device while a peer runs. A preset's big tensors are made
        on entry (the values its engines load) and go back to "meta" on exit, a checkpoint is
        loaded on entry and dropped on exit, so close every engine first: the device then holds
        one copy of the weights at a time. A checkpoint transformers cannot read whole (weights it
        would make up) is a BenchError."""
        if self.random is None:
            from transformers import AutoModelForCausalLM

            from hibana_bench.spec_systems import BenchError

            model, info = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype, output_loading_info=True)
            missing = sorted(info.get("missing_keys") or ())
            if missing:
                raise BenchError(f"transformers cannot read {self.name} whole: it lacks {len(missing)} weights "
                                 f"there ({', '.join(missing[:3])}, ...) and would run them randomly initialised; "
                                 "leave the hf_ systems out")
            model = model.to(self.device).eval().requires_grad_(False)
            try:
                yield model
            finally:
                del model
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            return
        swapped = _swap_meta_parameters(self.hf_model, self.random.make)
        try:
            yield self.hf_model
        finally:
            for module, key, meta in swapped:
                setattr(module, key, meta)
            gc.collect()  # a peer's caches may sit in cycles that hold the weights
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


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
    tokenizer's end of text is its end of sequence); the others have their own tokenizer, where
    they have one."""
    if name in PRESETS:
        spec = dict(PRESETS[name])
        tokenizer = chat_tokenizer() if chat else None
        if tokenizer is not None:
            spec.update(vocab_size=max(spec["vocab_size"], len(tokenizer)), eos_token_id=tokenizer.eos_token_id)
        model, random = _random_preset(spec, device, dtype)
    else:  # the engines load the checkpoint, the peers transformers' model of it (`peer_model`)
        from hibana_core.loader import load_tokenizer, planned_model, read_config, read_model_type, resolve_checkpoint

        path = resolve_checkpoint(name)
        config = read_config(path, read_model_type(path))  # (a plugin family's model_type too)
        weight_bytes, _ = planned_model(str(path), dtype)  # what the engine loads, in `dtype`, no weights read
        tokenizer = load_tokenizer(path, config)  # None: a checkpoint without one, timed as a preset
        return BenchModel(name, None, tokenizer, device, weight_bytes, None, path, config, dtype)
    model.eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return BenchModel(name, model, tokenizer, device, weight_bytes, random)


def preset_weight_bytes(name: str, dtype: torch.dtype) -> int:
    """The bytes a preset's weights take in `dtype` (MXFP4 experts as they are), nothing allocated."""
    model = _meta_preset(dict(PRESETS[name]), dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _meta_preset(spec: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """A preset's transformers model, all of it on "meta"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    mxfp4 = spec.pop("mxfp4_experts", False)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if mxfp4:
            for layer in model.model.layers:
                layer.mlp.experts = MXFP4Experts(model.config)
    if mxfp4:
        model.config.quantization_config = {"quant_method": "mxfp4"}
    return model


def _random_preset(spec: dict[str, Any], device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> tuple[torch.nn.Module, RandomWeights]:
    """A preset's transformers model on "meta" but for its small tensors, and its weights."""
    model = _meta_preset(spec, dtype)
    _init_small_tensors(model, device, seed)
    return model, RandomWeights(model, device, seed)


def _init_small_tensors(model: torch.nn.Module, device: torch.device, seed: int) -> None:
    """Vectors (norms, biases, attention sinks) and buffers (rotary frequencies) on the device as
    the model's own init makes them: norms are ones, or zeros where they scale by (1 + w) as
    Gemma's do; a vector its init leaves alone stays zero."""
    for module in model.modules():
        for key, p in list(module.named_parameters(recurse=False)):
            if p.dim() <= 1:
                setattr(module, key, torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device),
                                                        requires_grad=False))
        for key, b in list(module.named_buffers(recurse=False)):
            module._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device)  # keeps its persistence
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # sinks and router biases are drawn: the same every run
        for module in model.modules():
            model._init_weights(module)  # on the meta matrices, a no-op


class RandomWeights(Mapping):
    """A preset's weights by name, each made on the device when asked for, from a generator seeded
    by its name: the same name gives the same values every time, so the engine (which loads them
    one at a time, as from a checkpoint) and the peer (`BenchModel.peer_model`) run the same
    model. Matrices N(0, initializer_range) as transformers' init draws them; MXFP4 codes
    uniform, scales 2^-6 (values within +-6/64), expert biases zero; the small tensors are the
    model's own. Stands in for the transformers model in `Engine.from_hf_model` (config,
    generation_config, state_dict)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, seed: int) -> None:
        self.config, self.generation_config = model.config, model.generation_config
        self.device, self.seed = device, seed
        self.std = getattr(model.config, "initializer_range", None) or 0.02
        self._params = dict(model.named_parameters(remove_duplicate=False))
        first = {id(p): name for name, p in reversed(self._params.items())}
        self._seed_names = {name: first[id(p)] for name, p in self._params.items()}  # tied weights: one value

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        return self

    def __getitem__(self, name: str) -> torch.Tensor:
        p = self._params[name]
        return p.detach() if not p.is_meta else self.make(self._seed_names[name], p)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def make(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The values of weight `name` (shaped and typed as `like`) on the device."""
        generator = torch.Generator(self.device).manual_seed(self.seed << 32 | zlib.crc32(name.encode()))
        t = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        if t.dtype == torch.uint8:  # MXFP4 blocks (two 4-bit codes a byte) and e8m0 scales
            return t.fill_(127 - 6) if name.endswith("_scales") else t.random_(0, 256, generator=generator)
        if name.endswith("_bias"):  # stacked expert biases: zero, as transformers' init makes gpt-oss's
            return t.zero_()
        return t.normal_(0.0, self.std, generator=generator)


def _swap_meta_parameters(model: torch.nn.Module, make: Callable[[str, torch.Tensor], torch.Tensor],
                          ) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """Each "meta" parameter of `model` replaced by `make(name, parameter)` on the device (tied
    ones stay tied); returns (module, key, meta parameter) to put back."""
    names = {id(p): name for name, p in model.named_parameters()}
    made: dict[int, torch.nn.Parameter] = {}
    swapped = [(module, key, p) for module in model.modules()
               for key, p in module.named_parameters(recurse=False) if p.is_meta]
    for module, key, p in swapped:
        if id(p) not in made:
            made[id(p)] = torch.nn.Parameter(make(names[id(p)], p), requires_grad=False)
        setattr(module, key, made[id(p)])
    return swapped


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
