"""Train the bundled demo agent model: `python -m hibana_core.demo.train`.

    corpus      N seeded synthetic conversations (corpus.py), built by worker processes
    tokenizer   byte-level BPE, 4096 tokens, trained on the first conversations (tokenizer.py)
    model       Qwen3ForCausalLM from a Qwen3Config, loss on assistant tokens only, bf16 autocast
    checkpoint  config.json, generation_config.json, bf16 model.safetensors, tokenizer files
    evaluation  the held-out tasks (evaluate.py) on the freshly trained model

`--stage tokenizer` stops after the tokenizer (it is cheap: train it on a CPU and ship it);
`--tokenizer DIR` reuses one. The model wants a GPU: a few thousand steps take minutes on one.

Demo model v2 (issue 15): `--corpus v2 --shape v2` (corpus_v2.py's natural tools; 18.8M
parameters, 37.6 MB in bf16); `--corpus v3` is corpus_v3.py's open world, same shape; `--corpus v4`
(corpus_v4.py: synonyms, siblings, world knowledge; conversations up to 1536 tokens) needs pycountry. Training runs in chunks, each one device call:

    --train-dir DIR      the resumable state: tokenizer, the encoded corpus (built once, then
                         read back), train_state.pt (fp32 weights, AdamW moments, step, loss log)
    --checkpoint-every   steps between saves of train_state.pt (and one when the chunk ends)
    --chunk-minutes M    stop after M minutes of this call, save, exit 0; --resume continues there
                         (the schedule is over --steps in all, or the cut --max-minutes makes in
                         the first chunk, which is saved: a chunk does not change it)

`--mix v1=0.15,v3=0.2` draws those shares of the conversations from other corpora (conversation i
of the named corpus, chosen by its own seeded draw), the rest from --corpus; `--init DIR` starts
from a checkpoint's weights (same shape; pass `--tokenizer DIR` too), to fine-tune a trained model
on another mix at a lower --lr.

When the last step is reached the checkpoint (--out) is written and evaluated. The state lives on
the device machine's disk (it is too large to come back through $OUT); a cold machine starts over.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hibana_core.demo import corpus, template
from hibana_core.demo.template import END_OF_TURN

DEMO_DIR = Path(__file__).parent / "model"
MAX_TOKENS = 1024   # conversations longer than this are dropped (well under 1% of them)
MAX_TOKENS_V4 = 1536  # corpus v4's schemas are as wordy as real ones; real prompts run past 1024
CORPORA = ("v1", "v2", "v3", "v4")


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 768
    vocab: int = 4096
    max_positions: int = 2048


SHAPES = {"v1": ModelShape(),
          "v2": ModelShape(hidden=384, layers=10, heads=6, kv_heads=2, head_dim=64, intermediate=1152)}
"""v1: the bundled model (7.3M parameters); v2: 18.8M parameters, 37.6 MB in bf16 (the issue's 40 MB)."""


def conversation(corpus_name: str, seed: int | str, index: int, extended: bool = True):
    """Conversation `index` of the named corpus: v1 is run 3's (run 2's without `extended`). A
    mixed corpus is named like `v4+v1=0.15+v3=0.2` (see `mixed_name`)."""
    if "+" in corpus_name:
        base, *parts = corpus_name.split("+")
        draw = random.Random(f"mix:{corpus_name}:{seed}:{index}").random()
        for name, share in (p.split("=") for p in parts):
            draw -= float(share)
            if draw < 0:
                return conversation(name, seed, index, extended)
        return conversation(base, seed, index, extended)
    if corpus_name == "v2":
        from hibana_core.demo import corpus_v2

        return corpus_v2.conversation(seed, index)
    if corpus_name == "v3":
        from hibana_core.demo import corpus_v3

        return corpus_v3.conversation(seed, index)
    if corpus_name == "v4":
        from hibana_core.demo import corpus_v4

        return corpus_v4.conversation(seed, index)
    return corpus.conversation(seed, index, extended=extended)


def mixed_name(corpus_name: str, mix: str | None) -> str:
    """The corpus name for `--corpus` with `--mix NAME=SHARE,...` mixed in (checked)."""
    if not mix:
        return corpus_name
    parts = [p.strip().split("=") for p in mix.split(",") if p.strip()]
    if any(len(p) != 2 or p[0] not in CORPORA for p in parts):
        raise SystemExit(f"--mix {mix!r}: expected NAME=SHARE,... with names among {', '.join(CORPORA)}")
    shares = [float(share) for _, share in parts]
    if any(not 0 < x < 1 for x in shares) or sum(shares) >= 1:
        raise SystemExit(f"--mix {mix!r}: shares must be in (0, 1) and add up to less than 1")
    return "+".join([corpus_name] + [f"{name}={float(share):g}" for name, share in parts])


def qwen3_config(shape: ModelShape, tok):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_positions, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tok.token_to_id(END_OF_TURN), pad_token_id=tok.token_to_id("<|endoftext|>"))


# --- corpus -------------------------------------------------------------------------------------

_worker_tok = None


def _init_worker(tokenizer_file: str) -> None:
    global _worker_tok
    from tokenizers import Tokenizer

    _worker_tok = Tokenizer.from_file(tokenizer_file)


def _encode_range(args: tuple[str, int, int, int, bool]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Conversations [start, stop) of the corpus: token ids and the mask of trained positions."""
    corpus_name, seed, start, stop, extended = args
    rendered = [template.render_with_spans(c.messages, c.tools)
                for c in (conversation(corpus_name, seed, i, extended) for i in range(start, stop))]
    out, limit = [], MAX_TOKENS_V4 if corpus_name.split("+")[0] == "v4" else MAX_TOKENS
    for (text, spans), enc in zip(rendered, _worker_tok.encode_batch([t for t, _ in rendered])):
        if len(enc.ids) > limit:
            continue
        starts = np.array([s for s, _ in enc.offsets])
        mask = np.zeros(len(enc.ids), dtype=bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        out.append((np.array(enc.ids, dtype=np.uint16), mask))
    return out


def build_corpus(seed: int, n: int, tokenizer_file: Path, workers: int, extended: bool = True,
                 corpus_name: str = "v1") -> list[tuple[np.ndarray, np.ndarray]]:
    from tqdm.auto import tqdm

    chunk = 500
    jobs = [(corpus_name, seed, s, min(s + chunk, n), extended) for s in range(0, n, chunk)]
    data: list[tuple[np.ndarray, np.ndarray]] = []
    with multiprocessing.get_context("fork").Pool(workers, _init_worker, (str(tokenizer_file),)) as pool, \
            tqdm(total=n, desc="corpus", unit="conv", mininterval=1.0 if sys.stderr.isatty() else 10.0) as bar:
        for part in pool.imap(_encode_range, jobs):
            data.extend(part)
            bar.update(chunk)
    return data


def save_corpus(data, path: Path) -> None:
    lengths = np.array([len(ids) for ids, _ in data], dtype=np.int64)
    np.savez(path, lengths=lengths, ids=np.concatenate([ids for ids, _ in data]),
             mask=np.concatenate([m for _, m in data]))


def load_corpus(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    z = np.load(path)
    ends = np.cumsum(z["lengths"])
    ids, mask = np.split(z["ids"], ends[:-1]), np.split(z["mask"], ends[:-1])
    return list(zip(ids, mask))


def batches(data, batch_tokens: int, rng: random.Random):
    """Endless batches of conversations of similar length, padded to at most batch_tokens."""
    while True:
        order = list(range(len(data)))
        rng.shuffle(order)
        epoch = []
        for g in range(0, len(order), 2048):
            group = sorted(order[g:g + 2048], key=lambda i: len(data[i][0]))
            batch: list[int] = []
            for i in group:
                if batch and (len(batch) + 1) * len(data[i][0]) > batch_tokens:
                    epoch.append(batch)
                    batch = []
                batch.append(i)
            if batch:
                epoch.append(batch)
        rng.shuffle(epoch)
        yield from epoch


def collate(data, batch: list[int], pad_id: int):
    import torch

    width = -(-max(len(data[i][0]) for i in batch) // 64) * 64
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, i in enumerate(batch):
        n = len(data[i][0])
        ids[row, :n] = torch.from_numpy(data[i][0].astype(np.int64))
        mask[row, :n] = torch.from_numpy(data[i][1])
    return ids, mask


# --- model --------------------------------------------------------------------------------------

def train_model(args, tok, data):
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = True
    config = qwen3_config(model_shape(args), tok)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    if args.init is not None:
        from safetensors.torch import load_file

        weights = load_file(str(args.init / "model.safetensors"))
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:     # the head is tied to the embedding
            raise SystemExit(f"--init {args.init}: not this shape's weights (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}); pass the --shape it was trained with")
        model.tie_weights()
        print(f"weights: {args.init}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {n_params * 2 / 1e6:.1f} MB in bf16", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    steps, step, log = args.steps, 0, []
    state_file = args.train_dir / "train_state.pt" if args.train_dir else None
    if args.resume and state_file is not None and state_file.exists():
        state = torch.load(state_file, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, log, steps = state["step"], state["loss"], state["steps"]
        print(f"resumed at step {step} of {steps}", flush=True)

    def save_state() -> None:
        if state_file is not None:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "steps": steps,
                        "loss": log}, state_file.with_suffix(".tmp"))
            state_file.with_suffix(".tmp").replace(state_file)       # a killed call leaves the last good one

    lr_at = lambda step: args.lr * min(1.0, (step + 1) / args.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))
    stream = batches(data, args.batch_tokens, random.Random(f"{args.seed}:{step}"))   # a resumed chunk reshuffles
    pad_id = tok.token_to_id("<|endoftext|>")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    started, seen, first = time.time(), 0, step
    bar = tqdm(total=steps, initial=step, desc="train", unit="step", mininterval=1.0 if sys.stderr.isatty() else 30.0)
    while step < steps:
        if args.chunk_minutes and time.time() - started > args.chunk_minutes * 60:
            save_state()
            print(f"\nchunk ends at step {step} of {steps} ({time.time() - started:.0f}s); --resume continues",
                  flush=True)
            bar.close()
            return model, None
        ids, mask = collate(data, next(stream), pad_id)
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        target = mask[:, 1:]                                    # predict token t+1 where it is the model's
        with autocast:
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1][target]   # [n, hidden]
            logits = model.lm_head(hidden).float()                                   # [n, vocab]
        loss = F.cross_entropy(logits, ids[:, 1:][target])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        seen += ids.numel()
        step += 1
        bar.update()
        if step % 50 == 0 or step == steps:
            value = loss.item()
            log.append((step, value))
            bar.set_postfix(loss=f"{value:.3f}")
            if step == 150:
                warm = time.time()                              # steps before this one include warm-up
            if step == 300 and first == 0 and args.max_minutes:   # a resumed chunk keeps the saved cut
                per_step = (time.time() - warm) / 150
                fit = int((args.max_minutes * 60 - (time.time() - started)) / per_step) + step
                if fit < steps:
                    print(f"\n{per_step * 1000:.0f} ms/step: cutting {steps} steps to {fit} to fit "
                          f"--max-minutes {args.max_minutes}", flush=True)
                    steps = fit
                    bar.total = steps
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save_state()
            if step % 500 == 0:
                print(f"\nstep {step}: loss {value:.4f}, {seen / (time.time() - started) / 1e6:.2f}M tokens/s",
                      flush=True)
    bar.close()
    save_state()
    elapsed = time.time() - started
    print(f"trained {step} steps in {elapsed:.0f}s, {seen / 1e6:.0f}M tokens (padded), final loss {log[-1][1]:.4f}",
          flush=True)
    return model, {"steps": step, "seconds_last_chunk": round(elapsed, 1), "tokens_padded_last_chunk": seen,
                   "loss": log}


def save_checkpoint(model, tok_dir: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}                          # tied to the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.dtype = "bfloat16"
    model.config.save_pretrained(out)
    eos = model.config.eos_token_id
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "pad_token_id": model.config.pad_token_id, "do_sample": False}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tok_dir / name).resolve() != (out / name).resolve():
            shutil.copy(tok_dir / name, out / name)


# --- command line -------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hibana_core.demo.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEMO_DIR, help="checkpoint directory to write")
    p.add_argument("--stage", choices=("all", "tokenizer"), default="all")
    p.add_argument("--tokenizer", type=Path, help="reuse tokenizer.json / tokenizer_config.json from this directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=200_000)
    p.add_argument("--base-corpus", action="store_true",
                   help="run 2's corpus exactly (no side stream: no call syntax, no non-ASCII values)")
    p.add_argument("--corpus", choices=CORPORA, default="v1",
                   help="v2: corpus_v2.py's natural tools from many domains, with run 3's corpus mixed in; "
                        "v3: corpus_v3.py, v2's conversations over open values and open tools; "
                        "v4: corpus_v4.py, tools chosen by reading and values mapped with world knowledge")
    p.add_argument("--mix", help="NAME=SHARE,...: those shares of the conversations from other corpora")
    p.add_argument("--init", type=Path, help="start from this checkpoint's weights (fine-tuning)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="v1",
                   help="model size preset; --hidden etc. override single fields")
    p.add_argument("--train-dir", type=Path, help="resumable state: tokenizer, encoded corpus, train_state.pt")
    p.add_argument("--resume", action="store_true", help="continue from --train-dir's train_state.pt")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between saves of train_state.pt")
    p.add_argument("--chunk-minutes", type=float, default=0.0,
                   help="stop this call after M minutes, state saved (0: run to the last step)")
    p.add_argument("--tokenizer-conversations", type=int, default=20_000)
    p.add_argument("--workers", type=int, default=max(1, multiprocessing.cpu_count() - 1))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="cut the step count to fit, measured in the first chunk, kept by --resume (0: no limit)")
    p.add_argument("--batch-tokens", type=int, default=65536, help="padded tokens per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--device", default="auto")
    p.add_argument("--eval-tasks", type=int, default=200, help="held-out tasks after training (0: skip)")
    return p.parse_args(argv)


def model_shape(args: argparse.Namespace) -> ModelShape:
    base = SHAPES[args.shape]
    fields = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate")
    return ModelShape(**{f: getattr(args, f) if getattr(args, f) is not None else getattr(base, f) for f in fields})


def main(argv=None) -> int:
    args = parse_args(argv)
    from tokenizers import Tokenizer

    corpus_name = mixed_name(args.corpus, args.mix)

    if args.train_dir:
        args.train_dir.mkdir(parents=True, exist_ok=True)
    from hibana_core.demo import tokenizer as demo_tokenizer

    tok_dir = args.tokenizer or args.train_dir or args.out
    if args.tokenizer is None and args.resume and (tok_dir / "tokenizer.json").exists():
        print(f"tokenizer: reusing {tok_dir}", flush=True)
    elif args.tokenizer is None:
        sample = (conversation(corpus_name, f"tokenizer:{args.seed}", i) for i in range(args.tokenizer_conversations))
        texts = (template.render(c.messages, c.tools) for c in sample)
        tok = demo_tokenizer.train_tokenizer(texts)
        demo_tokenizer.save_tokenizer(tok, tok_dir, ModelShape().max_positions)
        print(f"tokenizer: {tok.get_vocab_size()} tokens -> {tok_dir}", flush=True)
        if args.stage == "tokenizer":
            return 0
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    t0 = time.time()
    cached = args.train_dir / f"corpus_{corpus_name}_{args.seed}_{args.conversations}.npz" if args.train_dir else None
    if cached is not None and cached.exists() and args.resume:
        data = load_corpus(cached)
    else:
        data = build_corpus(args.seed, args.conversations, tok_dir / "tokenizer.json", args.workers,
                            extended=not args.base_corpus, corpus_name=corpus_name)
        if cached is not None:
            save_corpus(data, cached)
    total = sum(len(ids) for ids, _ in data)
    trained = sum(int(m.sum()) for _, m in data)
    print(f"corpus: {len(data)} conversations, {total / 1e6:.1f}M tokens ({trained / 1e6:.1f}M trained), "
          f"{time.time() - t0:.0f}s", flush=True)
    model, report = train_model(args, tok, data)
    if report is None:                                  # a chunk ended before the last step
        return 0
    save_checkpoint(model, tok_dir, args.out)
    report.update(corpus=corpus_name, init=str(args.init) if args.init else None, conversations=len(data),
                  corpus_tokens=total, trained_tokens=trained)
    if args.eval_tasks:
        from hibana_core.demo import evaluate, perturb

        backend = evaluate.TransformersBackend(model, tok)
        for key, extended in (("eval", False), ("eval_extended", True)):
            result = evaluate.evaluate(backend, args.eval_tasks, extended=extended)
            print(("extended set: " if extended else "") + result.summary(), flush=True)
            report[key] = result.as_dict()
        result = evaluate.evaluate_v2(backend)          # reported, never tuned on (no grammar here)
        print("independent held-out set (heldout_v2.py), no grammar: " + result.summary(), flush=True)
        report["eval_heldout_v2_no_grammar"] = result.as_dict()
        gauge = perturb.evaluate(backend)               # unseen values / tool names / argument names
        print("corpus v2 calls with unseen words (perturb.py), no grammar:\n" + perturb.summary(gauge), flush=True)
        report["eval_perturbed_no_grammar"] = gauge
        if args.corpus == "v4":
            from hibana_core.demo import reading

            gauge = reading.evaluate(backend)           # tools of words no training conversation has
            print("corpus v4 first calls, seen and unseen words (reading.py), no grammar:\n" + perturb.summary(gauge),
                  flush=True)
            report["eval_reading_no_grammar"] = gauge
    (args.out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
