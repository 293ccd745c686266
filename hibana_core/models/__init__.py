"""Built-in model families, registered through the plugin hook like any third-party family.

A family is a module or object with `build(hf_config, ctx) -> (model, args)`, where the model is an
`nn.Module` with `forward(input_ids, positions) -> hidden` and `compute_logits(hidden)`, and args
has num_layers, num_kv_heads, head_dim, vocab_size and max_position_embeddings.
"""

from __future__ import annotations

from hibana_plugins.hookspecs import hookimpl

LLAMA_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@hookimpl
def register_model_families(register) -> None:
    from hibana_core.models import gemma3, llama, phi3, qwen3_moe

    for model_type in LLAMA_MODEL_TYPES:
        register(model_type, llama)
    for family in (gemma3, phi3, qwen3_moe):
        for model_type in family.MODEL_TYPES:
            register(model_type, family)
