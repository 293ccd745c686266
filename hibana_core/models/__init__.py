"""Built-in model families, registered through the plugin hook like any third-party family.

A family is a module or object with `build(hf_config, ctx) -> (model, args)`, where the model is an
`nn.Module` with `forward(input_ids, positions) -> hidden` and `compute_logits(hidden)`, and args
has num_layers, num_kv_heads, head_dim, vocab_size and max_position_embeddings. The built-in
families each name their MODEL_TYPES and read their configs into the shared decoder
(`decoder.py`; MoE families its sparse block, `moe.py`).
"""

from __future__ import annotations

from hibana_plugins.hookspecs import hookimpl


@hookimpl
def register_model_families(register) -> None:
    from hibana_core.models import (exaone4, gemma3, glm4_moe, gpt_oss, granite, llama, minimax_m2, mixtral, olmo,
                                    phi3, qwen3_5, qwen3_moe, smollm3)

    for family in (llama, gemma3, phi3, qwen3_moe, gpt_oss, mixtral, granite, glm4_moe, smollm3, exaone4, olmo,
                   minimax_m2, qwen3_5):
        for model_type in family.MODEL_TYPES:
            register(model_type, family)
