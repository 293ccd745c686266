"""Calibration: text a surgery pass may run the model on at load time.

A pass that measures the model's activations (kv8: the range of each head's keys and values)
declares `calibrated = True` and is called as `apply(model, params, calibration)`.

The text is `heldout/calibration.txt`: six demo agent conversations (`hibana_core.demo.corpus`,
seed "kv8-calibration", rendered with the demo chat template) and one document of prose, code and
JSON. None of it is in the guard's held-out text, so the guard never scores a pass on the text it
was calibrated on. A checkpoint without a tokenizer is calibrated on seeded random tokens.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from hibana_core.forward_context import ForwardContext

CALIBRATION_TEXT = Path(__file__).parent / "heldout" / "calibration.txt"
MAX_TOKENS = 4096     # calibration tokens in all
MAX_DOCUMENT = 1024   # tokens per document at most
RANDOM_DOCUMENTS = 4  # without a tokenizer: this many documents of MAX_DOCUMENT // 2 random tokens


class Calibration:
    """The calibration documents (token ids) and scratch forwards of the model over them."""

    def __init__(self, model: torch.nn.Module, ctx: ForwardContext, args: Any, dtype: torch.dtype,
                 device: torch.device, tokenizer: Any = None) -> None:
        self.model, self.ctx, self.args, self.dtype, self.device = model, ctx, args, dtype, device
        self.tokenizer = tokenizer

    @functools.cached_property
    def documents(self) -> list[list[int]]:
        from hibana_core.surgery.guard import DOCUMENT_SEPARATOR

        vocab, longest = self.args.vocab_size, min(MAX_DOCUMENT, self.args.max_position_embeddings)
        if self.tokenizer is None:
            rng = random.Random("hibana-calibration")
            return [[rng.randrange(vocab) for _ in range(longest // 2)] for _ in range(RANDOM_DOCUMENTS)]
        documents, total = [], 0
        for part in CALIBRATION_TEXT.read_text(encoding="utf-8").split(DOCUMENT_SEPARATOR):
            ids = [i for i in self.tokenizer(part, add_special_tokens=False)["input_ids"] if i < vocab]
            ids = ids[:min(longest, MAX_TOKENS - total)]
            if ids:
                documents.append(ids)
                total += len(ids)
        return documents

    @property
    def source(self) -> str:
        tokens = sum(map(len, self.documents))
        what = CALIBRATION_TEXT.name if self.tokenizer is not None else "random tokens (no tokenizer)"
        return f"{what}, {tokens} tokens"

    def kv(self, tokens: Sequence[int]) -> torch.Tensor:
        """[num_layers, 2, len(tokens), H_kv, D]: the keys and values the model, as it is now,
        stores for `tokens` (one forward from position 0 on a scratch cache)."""
        from hibana_core.surgery.guard import Scorer

        scorer = Scorer(self.model, self.ctx, self.args, self.dtype, self.device, len(tokens))
        return scorer.kv(tokens)
