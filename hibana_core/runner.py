"""Model runner: prepares the batch tensors of a step once, runs the forward, samples.

The only host synchronisation of a step is reading the sampled tokens back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hibana_core.forward_context import ForwardBatch, ForwardContext
from hibana_core.sampler import Sampler, SamplingRow
from hibana_core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    batch: ForwardBatch
    logits_indices: torch.Tensor  # [S]: rows of the sequences that sample this step


class ModelRunner:
    def __init__(self, model: torch.nn.Module, ctx: ForwardContext, sampler: Sampler,
                 device: torch.device) -> None:
        self.model, self.ctx, self.sampler, self.device = model, ctx, sampler, device

    def prepare(self, output: SchedulerOutput) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        for chunk in output.chunks:
            seq = chunk.request.seq
            end = chunk.start + chunk.num_tokens
            ids.extend(seq.tokens[chunk.start:end])
            positions.extend(range(chunk.start, end))
            slots.extend(seq.slot(p) for p in range(chunk.start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + chunk.num_tokens)
            tables.append(seq.block_ids)
            if chunk.sample:
                logits_indices.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=self.device)

        batch = ForwardBatch(
            slot_mapping=tensor(slots),
            block_tables=tensor(padded, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(starts, torch.int32),
            max_query_len=max(c.num_tokens for c in output.chunks),
            max_seq_len=max(seq_lens),
        )
        return ModelInput(tensor(ids), tensor(positions), batch, tensor(logits_indices))

    @torch.inference_mode()
    def step(self, output: SchedulerOutput) -> list[int]:
        """Run one scheduled step; returns one sampled token per sampling chunk, in order."""
        inputs = self.prepare(output)
        with self.ctx.forward_batch(inputs.batch):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        rows = [c.request for c in output.chunks if c.sample]
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, vocab]
        sampling_rows = [SamplingRow(r.params, r.generator, r.history, r.output) for r in rows]
        return self.sampler(logits, sampling_rows).tolist()
