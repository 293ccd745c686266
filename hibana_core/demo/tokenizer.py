"""The demo model's tokenizer: byte-level BPE trained on the corpus with `tokenizers`.

Ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|> (special); the last four ids of the vocabulary
are the tool tags, added as ordinary tokens (as in Qwen) so they survive skip_special_tokens.
Pre-tokenization is Qwen 2's: digits one by one, which keeps numbers easy to copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from hibana_core.demo.template import CHAT_TEMPLATE, END_OF_TURN, SPECIAL_TOKENS, TOOL_TOKENS

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TOOL_TOKENS), min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}; "
                           "the corpus sample is too small for this vocabulary")
    return tok


def save_tokenizer(tok, out: Path, model_max_length: int) -> None:
    """tokenizer.json plus a tokenizer_config.json carrying the chat template."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t in SPECIAL_TOKENS}
             for t in SPECIAL_TOKENS + TOOL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": END_OF_TURN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
