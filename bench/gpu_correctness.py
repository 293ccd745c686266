"""GPU path checks, run on the device machine (bench/run_h200.sh):

1. float32: the CUDA path (Triton kernels, with and without CUDA graphs) gives the CPU path's
   greedy tokens on the tiny test checkpoints, 4 agents batched.
2. bfloat16: the demo model on the GPU gives transformers' greedy tokens for at least the first
   32 tokens of 8 prompts; at batch 1 (one prompt at a time: one-row GEMVs, CUDA graphs) with
   every kernel fusion on (`hibana_kernels.fusion`) the tokens are those with none, and agree
   with transformers as often; so are those with silu in the gate/up GEMV's epilogue.
3. speculation: on the GPU (eager, and CUDA graphs of verify steps), float32, the tiny checkpoints
   give the CPU's speculation-off greedy tokens with speculation on, 4 agents batched with mixed
   draft lengths (suffix k=4 and k=8, ngram k=2, adaptive) on histories that repeat themselves
   (so drafts are accepted and rejected); and bf16 demo model: spec on == spec off.
4. surgery: each pass (w8, w4), float32, GPU kernels == CPU references, greedy; on the MoE
   checkpoints too (their experts packed to int8 / int4: the fused-MoE kernels' int8 and int4
   paths, decode at 4 agents, grouped in prefill).
5. kv8: the fp8 KV cache, float32 compute, GPU (eager and CUDA graphs, speculation off and mixed)
   == CPU reference, greedy, 4 agents batched: both quantize to the same bytes (round to nearest
   even by the same rule, with the same power-of-two scales: a mismatch in the scales is
   reported as such) and read them back exactly. Also the bf16 demo model with kv8 on the GPU,
   speculation mixed vs off.
6. fp8 checkpoints (tests/fp8_checkpoints.py: transformers 'fp8' in 16x16 blocks, in 24x40 blocks
   that fused layers hold per row, per tensor; compressed-tensors per channel where installed),
   float32: GPU (fp8 GEMV at 3 agents, GEMM at 6, dequantize + cuBLAS in prefill) == CPU, greedy.
7. families (issue 18): gemma3, phi3 (also with LongRoPE's switch at 64 tokens, inside the
   histories), qwen3_moe, gpt_oss and mixtral (MoE routers with tied rows; mixtral also with
   sliding_window 20), granite (its four multipliers), float32,
   GPU == transformers on the GPU, greedy, 4 agents batched, eager and CUDA graphs; gpt_oss also
   from an MXFP4 checkpoint (the experts' Triton MXFP4 paths) against transformers' dequantized
   model. (Checks 1, 3 and 5 run them too, GPU == CPU, with routers free of ties.)
8. logprobs (issue 16): float32, the GPU (eager and CUDA graphs, speculation off and suffix k=4)
   returns each chosen token's log-probability and the top 5 as transformers' log_softmax on the
   GPU gives them (within 1e-3), 4 agents batched (two greedy with logprobs, one sampled with
   logprobs, one without: its tokens unchanged and no logprobs returned).
9. tiers (issue 17): the host tier's copies on a side stream; agents in tool loops under a tight
   kv_device_blocks park, resume and are prefetched, greedy equal to an unbounded run, float32,
   graphs off and on.
10. grammar (issue 15): float32, 8 agents batched, half under a JSON schema (greedy through the
   masks filled on the host while the device runs the forward, copied from pinned buffers taken
   in turn), half free: the GPU (eager and CUDA graphs, speculation off and suffix k=4) gives the
   CPU's tokens for both halves, the free agents the tokens they get alone, and every constrained
   output that ended is JSON of the schema.
logit_bias: the GPU sampler's `logit_bias`, float32, 4 agents batched (eager and CUDA graphs,
   speculation off, suffix k=4 and the target as its own draft model): greedy agents with a bias == transformers' generate with the
   same sequence_bias on the GPU; an agent without one keeps its tokens; a sampled one never draws
   a banned token.
shapes: check 1 on shapes unlike the tiny checkpoints' (tiny_models.ODD_SHAPES: head_dim 8, 12
   and 24, one KV head or as many as query heads, windows shorter than a block), GPU == CPU.
moe_fusion: qwen3_moe and gpt_oss in bf16, batch 1: the sparse block's norm, router and top-k in
   one launch (fusion `moe_norm_route`) give the tokens of the three launches (3 of 4 prompts at
   least: bf16 logits summed in another order may part a near-tie).
unit_offset_fold: qwen3_5, qwen3_5_moe, qwen3_next and gemma3 in bf16, batch 1: Gemma's norm folded into
   the GEMV after it gives the tokens of the separate norm and GEMV (3 of 4 prompts at least).
a8_fold: bf16 w8 / w4 one agent at a time: the norm's, SiLU-and-mul's and attention merge's launches
   writing x's int8 codes (`Fusion.a8_fold`) give the tokens of the separate quantize launches.
moe_a8: bf16 gpt_oss with MXFP4 experts, one agent at a time: the experts against int8 x (the default
   decode tiles) beside the float GEMV: the first decoded token of every prompt, and half the
   prompts throughout, agree.
moe_folds: qwen3_moe and gpt_oss with MXFP4 experts in bf16, batch 1: the down projection summing a
   token's routes (`Fusion.moe_combine`) and the norm writing MXFP4's int8 x (`Fusion.a8_fold`) give the
   tokens of the separate launches, every prompt throughout.
Prints a table; exits 1 if a check fails.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hibana_core import Engine, SamplingParams  # noqa: E402
from hibana_kernels.fusion import Fusion  # noqa: E402
from tiny_models import ARCHS, ODD_SHAPES  # noqa: E402  every family's tiny checkpoint, other shapes


ON_GPU = {"device": "cuda", "memory_budget": os.environ.get("CHECK_MEMORY_BUDGET", "8GB")}
"""Every GPU engine of a check: its own budget, so that the checks run as parallel processes
(`run_h200.sh check`) do not each size their KV from what the others left free."""

MIXED_SPECULATION = ({"method": "suffix", "k": 4}, "adaptive", {"method": "ngram", "k": 2},
                     {"method": "suffix", "k": 8})


def in_threads(run: Callable[[int], None], n: int) -> None:
    """run(0), ..., run(n - 1) at once, each in its own thread (agents batched by the engine)."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def batched_greedy(engine: Engine, prompts: list[list[int]], n: int, specs=None, prefix: str = "p") -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        h = engine.open_state(f"{prefix}{i}")
        spec = None if specs is None else specs[i % len(specs)]
        params = SamplingParams(max_tokens=n, ignore_eos=True, speculation=spec)
        out[i] = list(h.generate(params, prompt=prompts[i]).token_ids)

    in_threads(run, len(prompts))
    return out



def tiny_cases(archs: tuple[str, ...], seed: int, max_prompt: int = 300, tied_experts: bool = False,
               overrides: dict[str, dict] | None = None) -> Iterator[tuple[str, Path, list[list[int]]]]:
    """(arch, checkpoint, 4 prompts of 20..max_prompt random tokens) for each tiny architecture,
    the checkpoints in a temporary folder that lasts while the caller iterates. MoE routers
    have no tied experts unless `tied_experts` (CUDA's top-k breaks ties otherwise than the
    CPU's, as transformers' own routing does: GPU-vs-CPU rows would differ by design);
    `overrides` (arch -> config fields) replace fields of an architecture's tiny config."""
    from tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            path = make_tiny_checkpoint(arch, Path(tmp) / arch, tied_experts=tied_experts,
                                        **(overrides or {}).get(arch, {}))
            rng = random.Random(seed)
            yield arch, path, [[rng.randrange(2, 512) for _ in range(rng.randint(20, max_prompt))] for _ in range(4)]


def check_float32(seed: int = 7, overrides: dict | None = None, label: str = "fp32") -> Iterator[tuple[str, bool, str]]:
    """Float32 on the GPU (graphs off and on) equals the CPU, 4 agents batched per family."""
    for arch, path, prompts in tiny_cases(ARCHS, seed, overrides=overrides):
        yield from gpu_equals_cpu(path, prompts, f"{label} {arch}")


def gpu_equals_cpu(path: Path, prompts: list[list[int]], label: str) -> Iterator[tuple[str, bool, str]]:
    """The engine in float32 on the GPU, graphs off and on, against the engine on the CPU: 32
    greedy tokens of 4 agents batched."""
    with Engine.from_pretrained(path, device="cpu", dtype="float32", progress=False) as cpu:
        want = batched_greedy(cpu, prompts, 32)
    for graphs in (False, True):
        with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, cuda_graphs=graphs) as gpu:
            got = batched_greedy(gpu, prompts, 32)
        same = sum(a == b for a, b in zip(got, want))
        yield (f"{label} graphs={graphs}", same == len(prompts), f"{same}/4 agents equal")


def check_shapes() -> Iterator[tuple[str, bool, str]]:
    """check_float32 on shapes unlike the tiny checkpoints' (tiny_models.ODD_SHAPES: head_dim
    8, 12 and 24, one KV head or as many as query heads, windows shorter than a block)."""
    return check_float32(13, ODD_SHAPES, "shapes fp32")


SURGERY = ("w8", {"name": "w4", "group_size": 32})


def check_surgery() -> Iterator[tuple[str, bool, str]]:
    """Each surgery pass, float32 compute: the GPU (Triton dequantizing kernels, graphs on) gives
    the CPU references' greedy tokens on the tiny checkpoints, 4 agents batched (the packed
    weights are the same: quantization runs on each device from the same float weights)."""
    for arch, path, prompts in tiny_cases(("llama", "qwen3", "qwen3_moe", "gpt_oss"), 5):
        for surgery in SURGERY:
            options = dict(progress=False, surgery=[surgery], surgery_guard=False, speculation="off")
            with Engine.from_pretrained(path, device="cpu", **options) as cpu:
                want = batched_greedy(cpu, prompts, 32)
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", **options) as gpu:
                got = batched_greedy(gpu, prompts, 32)
            same = sum(a == b for a, b in zip(got, want))
            name = surgery if isinstance(surgery, str) else f"{surgery['name']} g{surgery['group_size']}"
            yield (f"surgery {name} fp32 {arch}", same == len(prompts), f"{same}/4 agents equal")


def check_a8_fold() -> Iterator[tuple[str, bool, str]]:
    """bf16 w8 / w4 on the GPU, one agent at a time (one-row steps: the x int8 GEMV): the norm,
    SiLU-and-mul and attention launches that write x's int8 codes (`Fusion.a8_fold`, AUTO's) give
    the same tokens as the separate quantize launches: the same codes of the same bf16 rows."""
    import hibana_kernels as kernels
    from hibana_kernels import fusion

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    folds = {"rms_norm_a8": 0, "silu_and_mul_a8": 0, "paged_attention_a8": 0}  # the folds really ran
    originals = {name: getattr(kernels, name) for name in folds}

    def counted(name):
        def call(*args, **kwargs):  # (paged_attention_a8 takes its prologue by keyword)
            folds[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in folds:
        setattr(kernels, name, counted(name))
    try:
        for arch, path, prompts in tiny_cases(("llama", "qwen3"), 5):
            for surgery in SURGERY:
                outputs = {}
                for fold in (False, True):
                    policy = dataclasses.replace(fusion.AUTO, a8_fold=fold)
                    with fusion.using(policy), Engine.from_pretrained(path, **ON_GPU, dtype="bfloat16",
                                                                     progress=False, surgery=[surgery],
                                                                     surgery_guard=False, speculation="off") as engine:
                        outputs[fold] = [list(engine.open_state(f"one{i}").generate(params, prompt=p).token_ids)
                                         for i, p in enumerate(prompts)]
                same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
                name = surgery if isinstance(surgery, str) else f"{surgery['name']} g{surgery['group_size']}"
                ran = all(folds.values())
                yield (f"a8 fold {name} bf16 {arch}: x's codes from the norm / SiLU / attention",
                       same == len(prompts) and ran, f"{same}/{len(prompts)} agents equal; folded launches {folds}")
                folds.update(dict.fromkeys(folds, 0))
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)


def kv_scales(engine: Engine) -> list[torch.Tensor]:
    layers = sorted((m.layer_idx, m) for m in engine.model.modules() if hasattr(m, "set_kv_scales"))
    return [m.kv_scale.cpu() for _, m in layers]


def prompt_kv(engine: Engine, state_id: str, n: int) -> torch.Tensor:
    """The KV bytes of a state's first n tokens in its first layer group (every layer unless sliding
    windows split them: `KVLayout`), [group layers, 2, n, H_kv, D] uint8 on the host."""
    blocks = engine.registry._entries[state_id].seq.block_ids
    return engine.kv_cache.read_blocks(blocks).flatten(2, 3)[:, :, :n].view(torch.uint8)


def check_kv8() -> Iterator[tuple[str, bool, str]]:
    """kv8, float32 compute: the GPU's greedy tokens are the CPU reference's. Each device
    calibrates its own scales from the same float weights; they must come out equal (powers of
    two, so a last-bit difference in a calibration run changes nothing). The bytes stored for a
    prompt are compared too: quantization is the same rule on both (test_kernels.py checks it
    byte for byte on CUDA from the same inputs), but cuBLAS and the CPU round float32 keys and
    values in their last bits differently, and a value that close to an fp8 rounding boundary
    may take the neighbouring code, so nearly all, not all, bytes must be equal. In a MoE model a
    router near-tie that float32's last bits settle otherwise sends one token to another expert
    in one layer, and every later layer's KV of that token differs: there 99%, not 99.9% (the
    H200 gave 99.52% for qwen3_moe, its 32 tokens of 8 generations all equal)."""
    for arch, path, prompts in tiny_cases(ARCHS, 17):
        options = dict(progress=False, surgery=["kv8"], surgery_guard=False, dtype="float32")
        with Engine.from_pretrained(path, device="cpu", speculation="off", **options) as cpu:
            first = batched_greedy(cpu, prompts, 32)
            cpu_kv = prompt_kv(cpu, "p0", len(prompts[0]))
            repeat = [p + f + p for p, f in zip(prompts, first)]  # drafts accepted and rejected
            want = batched_greedy(cpu, repeat, 32)
            cpu_scales = kv_scales(cpu)
        for graphs, spec in ((False, "off"), (True, "off"), (True, "mixed")):
            with Engine.from_pretrained(path, **ON_GPU, cuda_graphs=graphs,
                                        speculation="off" if spec == "off" else "adaptive", **options) as gpu:
                scales_equal = all(torch.equal(a, b) for a, b in zip(kv_scales(gpu), cpu_scales))
                got_first = batched_greedy(gpu, prompts, 32)
                bytes_equal = (prompt_kv(gpu, "p0", len(prompts[0])) == cpu_kv).float().mean().item()
                got = batched_greedy(gpu, repeat, 32, None if spec == "off" else MIXED_SPECULATION)
                accepted = gpu.stats().draft_tokens_accepted
            same = sum(a == b for a, b in zip(got, want)) + sum(a == b for a, b in zip(got_first, first))
            least = 0.99 if arch in ("qwen3_moe", "gpt_oss") else 0.999
            ok = same == 2 * len(prompts) and scales_equal and bytes_equal > least and (spec == "off" or accepted > 0)
            yield (f"kv8 fp32 {arch} graphs={graphs} spec={spec}", ok,
                   f"{same}/8 generations equal; scales equal: {scales_equal}; a prompt's KV "
                   f"bytes equal: {bytes_equal:.4%}" + (f"; {accepted} drafts accepted" if spec != "off" else ""))
    with Engine.from_pretrained("demo", **ON_GPU, dtype="bfloat16", progress=False, surgery=["kv8"]) as engine:
        guard = engine.surgery[0]["guard"]
        chat = engine.chat("render")
        questions = ["What is 12 plus 30?", "Hello! How are you today?", "What is 7 times 8?", "Say hi."]
        prompts = [chat.prompt_ids([{"role": "user", "content": q}]) for q in questions]
        off = batched_greedy(engine, prompts, 32, specs=["off"])
        on = batched_greedy(engine, prompts, 32, MIXED_SPECULATION)
    same = sum(a == b for a, b in zip(on, off))
    yield ("kv8 bf16 demo, speculation mixed vs off (graphs)", same == len(prompts),
           f"{same}/4 prompts equal; guard on the GPU: ppl x{guard['ppl_ratio']:.4f}, top-1 "
           f"{guard['top1_agreement']:.1%}, KL {guard['mean_kl']:.4f}: {guard['decision']}")


def check_speculation() -> Iterator[tuple[str, bool, str]]:
    for arch, path, prompts in tiny_cases(ARCHS, 11, max_prompt=200):
        with Engine.from_pretrained(path, device="cpu", progress=False, speculation="off") as cpu:
            first = batched_greedy(cpu, prompts, 48)
            # the history repeats itself: the drafters find the continuation (and then diverge)
            prompts = [p + f + p for p, f in zip(prompts, first)]
            want = batched_greedy(cpu, prompts, 48)
        for graphs in (False, True):
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False,
                                        cuda_graphs=graphs) as gpu:
                got = batched_greedy(gpu, prompts, 48, MIXED_SPECULATION)
                stats = gpu.stats()
            same = sum(a == b for a, b in zip(got, want))
            ok = same == len(prompts) and stats.draft_tokens_accepted > 0
            yield (f"spec fp32 {arch} graphs={graphs}", ok,
                   f"{same}/4 agents equal; {stats.draft_tokens_accepted}/{stats.draft_tokens_proposed} "
                   f"drafts accepted in {stats.verify_steps} verify steps of {stats.steps}")
        if arch != "qwen3":
            continue
        # the draft-model drafter runs its own forwards (its graphs too): the checkpoint drafts
        # for itself, so nearly every draft is accepted and every path of the drafter runs
        for graphs in (False, True):
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, cuda_graphs=graphs,
                                        speculation={"method": "draft_model", "draft_model": str(path),
                                                     "k": 4}) as gpu:
                got = batched_greedy(gpu, prompts, 48)
                stats = gpu.stats()
            same = sum(a == b for a, b in zip(got, want))
            ok = same == len(prompts) and stats.draft_tokens_accepted > 0
            yield (f"draft model fp32 {arch} graphs={graphs}", ok,
                   f"{same}/4 agents equal; {stats.draft_tokens_accepted}/{stats.draft_tokens_proposed} "
                   f"drafts accepted")
        # sampling without a seed: drafts drawn from the draft model's q and kept at min(1, p/q);
        # q = p up to rounding here, so nearly all are kept (the argmax would be kept at p's rate)
        for graphs in (False, True):
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, cuda_graphs=graphs,
                                        speculation={"method": "draft_model", "draft_model": str(path),
                                                     "k": 4}) as gpu:
                outs = sampled(gpu, prompts, 48, SamplingParams(max_tokens=48, ignore_eos=True, temperature=1.0,
                                                                top_k=50))
                stats = gpu.stats()
            ok = (all(len(o) == 48 for o in outs) and stats.draft_tokens_proposed > 100
                  and stats.draft_tokens_accepted >= 0.97 * stats.draft_tokens_proposed)
            yield (f"drawn drafts fp32 {arch} graphs={graphs}", ok,
                   f"{stats.draft_tokens_accepted}/{stats.draft_tokens_proposed} drawn drafts kept (want >= 97%)")


def sampled(engine: Engine, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[int]]:
    """Each prompt's n sampled tokens, the agents batched."""
    out: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        out[i] = list(engine.open_state(f"s{i}").generate(params, prompt=prompts[i]).token_ids)

    in_threads(run, len(prompts))
    return out


def one_at_a_time(prompts: list[list[int]], n: int, policy: str | Fusion) -> list[list[int]]:
    """Greedy tokens of the bf16 demo model, one prompt at a time (batch-1 decode graphs),
    under a kernel-fusion policy (a name or a `hibana_kernels.fusion.Fusion`)."""
    from hibana_kernels import fusion

    params = SamplingParams(max_tokens=n, ignore_eos=True)
    with fusion.using(policy), Engine.from_pretrained("demo", **ON_GPU, dtype="bfloat16", progress=False,
                                                     speculation="off") as engine:
        return [list(engine.open_state(f"one{i}").generate(params, prompt=p).token_ids)
                for i, p in enumerate(prompts)]


def check_bf16_demo() -> Iterator[tuple[str, bool, str]]:
    from transformers import AutoModelForCausalLM

    from hibana_kernels import fusion

    from hibana_core.loader import DEMO_MODEL_DIR

    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.bfloat16).cuda().eval()
    with Engine.from_pretrained("demo", **ON_GPU, dtype="bfloat16", progress=False) as engine:
        chat = engine.chat("render")
        tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                  "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                  "b": {"type": "number"}}}}}]
        questions = ["What is 12 plus 30?", "Hello! How are you today?", "What is 7 times 8?",
                     "Tell me something about cats.", "What is 1000 minus 1?", "Say hi.",
                     "What is 3 plus 4?", "Can you help me plan a trip?"]
        prompts = [chat.prompt_ids([{"role": "user", "content": q}], tools if i % 2 == 0 else None)
                   for i, q in enumerate(questions)]
        got = batched_greedy(engine, prompts, 32, specs=["off"])
        spec = batched_greedy(engine, prompts, 32, MIXED_SPECULATION)
        spec_stats = engine.stats()
    single = {policy: one_at_a_time(prompts, 32, policy) for policy in ("on", "off")}
    # silu in the gate/up GEMV's epilogue (AUTO takes it only at widths the demo does not have)
    single["glu"] = one_at_a_time(prompts, 32, dataclasses.replace(fusion.AUTO, silu_max_k=0, glu_silu_max_n=sys.maxsize))

    def greedy(model, prompt):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()

    def agreement(a_runs, b_runs):
        firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 32) for x, y in zip(a_runs, b_runs)]
        return sum(f == 32 for f in firsts), firsts

    sdpa = [greedy(hf, p) for p in prompts]
    eager_model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.bfloat16,
                                                       attn_implementation="eager").cuda().eval()
    eager = [greedy(eager_model, p) for p in prompts]
    matched, firsts = agreement(got, sdpa)
    noise, noise_firsts = agreement(eager, sdpa)
    spec_same = sum(a == b for a, b in zip(spec, got))
    fused_same = sum(a == b for a, b in zip(single["on"], single["off"]))
    glu_same = sum(a == b for a, b in zip(single["glu"], single["off"]))
    fused_hf, fused_firsts = agreement(single["on"], sdpa)
    unfused_hf, unfused_firsts = agreement(single["off"], sdpa)
    return [("bf16 demo vs transformers (sdpa), first 32 tokens", matched == len(prompts),
             f"{matched}/8 prompts equal; first difference at {firsts}"),
            ("bf16 demo batch 1, kernel fusion on vs off", fused_same == len(prompts),
             f"{fused_same}/8 prompts equal"),
            ("bf16 demo batch 1, silu in the gate/up GEMV vs fusion off", glu_same == len(prompts),
             f"{glu_same}/8 prompts equal"),
            ("bf16 demo batch 1 vs transformers (sdpa), fusion on / off", fused_hf >= unfused_hf,
             f"{fused_hf}/8 and {unfused_hf}/8 prompts equal; first differences at {fused_firsts} / {unfused_firsts}"),
            ("bf16 demo, speculation mixed vs off (graphs)", spec_same == len(prompts),
             f"{spec_same}/8 prompts equal; {spec_stats.draft_tokens_accepted}/"
             f"{spec_stats.draft_tokens_proposed} drafts accepted"),
            ("reference: transformers eager vs sdpa, bf16", True,
             f"{noise}/8 prompts equal; first difference at {noise_firsts}")]


FP8_CASES = (("llama", "fp8", (16, 16)), ("llama", "fp8", (24, 40)), ("llama", "fp8-tensor", (0, 0)),
             ("llama", "ct-channel", (0, 0)), ("qwen3", "fp8", (32, 16)))


def check_fp8() -> Iterator[tuple[str, bool, str]]:
    """FP8 checkpoints, float32 compute: the GPU's fp8 kernels give the CPU references' greedy
    tokens, 3 agents batched (decode takes the GEMV), then 6 (the GEMM); prefill takes
    dequantize + cuBLAS."""
    import importlib.util

    from fp8_checkpoints import write_fp8_checkpoint
    from tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        for arch, scheme, block in FP8_CASES:
            name = f"fp8 {scheme} {block[0]}x{block[1]} fp32 {arch}"
            if scheme.startswith("ct-") and importlib.util.find_spec("compressed_tensors") is None:
                yield (name, True, "skipped: compressed-tensors not installed")
                continue
            source = Path(tmp) / arch
            if not source.exists():
                make_tiny_checkpoint(arch, source)
            path = Path(tmp) / f"{arch}-{scheme}-{block[0]}x{block[1]}"
            write_fp8_checkpoint(source, path, scheme, block)
            rng = random.Random(9)
            batches = {agents: [[rng.randrange(2, 512) for _ in range(rng.randint(20, 200))] for _ in range(agents)]
                       for agents in (3, 6)}
            options = dict(progress=False, speculation="off")
            with Engine.from_pretrained(path, device="cpu", **options) as cpu:
                want = {a: batched_greedy(cpu, prompts, 32, prefix=f"b{a}-") for a, prompts in batches.items()}
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", **options) as gpu:
                got = {a: batched_greedy(gpu, prompts, 32, prefix=f"b{a}-") for a, prompts in batches.items()}
            same = {a: sum(x == y for x, y in zip(got[a], want[a])) for a in batches}
            yield (name, all(same[a] == a for a in batches),
                   ", ".join(f"{same[a]}/{a} agents equal" for a in batches))


FAMILIES = ("gemma3", "phi3", "qwen3_moe", "gpt_oss")


def family_cases() -> Iterator[tuple[str, Path, list[list[int]]]]:
    """`tiny_cases` of FAMILIES with tied router rows, and gpt_oss again with untied routers, with
    float and with MXFP4 experts, on the same prompts."""
    from tiny_models import make_mxfp4_checkpoint, make_tiny_checkpoint

    overrides = {} if transformers_reads_swiglu_limit() else {"gpt_oss": {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}}
    for arch, path, prompts in tiny_cases(FAMILIES, 23, tied_experts=True, overrides=overrides):
        yield arch, path, prompts
        if arch == "phi3":  # LongRoPE's switch inside the prompts and generations: long tables, recomputes
            yield "phi3 switch 64", make_tiny_checkpoint(arch, path.parent / "phi3-64",
                                                         original_max_position_embeddings=64), prompts
        if arch == "gpt_oss":
            untied = make_tiny_checkpoint(arch, path.parent / "gpt_oss-untied", tied_experts=False,
                                          **overrides.get(arch, {}))
            yield "gpt_oss untied", untied, prompts
            # MXFP4 from the untied one: the reference runs on the CPU, whose torch.topk breaks
            # ties otherwise than CUDA's (the tied MXFP4 row gave 2/4 on 2026-12-01)
            yield "gpt_oss untied mxfp4", make_mxfp4_checkpoint(untied, path.parent / "gpt_oss-mxfp4"), prompts
    yield from extra_family_cases(23)


EXTRA_FAMILIES = ("mixtral", "granite", "glm4_moe", "minimax_m2", "ministral3", "smollm3", "exaone4", "olmo2", "olmo3",
                  "qwen3_5", "qwen3_5_moe", "qwen3_next")
"""Families with tiny checkpoints (tiny_models.ARCH_CONFIGS) outside tiny_models.ARCHS (so checks 1,
3 and 5 do not run them): tests/test_family_mixtral_granite.py's, test_family_glm4_moe.py's,
test_family_minimax_m2.py's,
test_family_smollm3.py's (a NoPE layer), test_family_exaone4.py's and test_family_olmo.py's (post-norm
layers; OLMo's q/k norms over whole projections), test_family_qwen3_5.py's (hybrids: linear-attention
layers on the recurrent kernels; CUDA graphs stay off for them), and
test_families.py's ministral3 (queries scaled past position 256, which prompts of up to 300 tokens
cross)."""


def extra_family_cases(seed: int) -> Iterator[tuple[str, Path, list[list[int]]]]:
    """`tiny_cases` of EXTRA_FAMILIES (routers tied in pairs), and mixtral again windowed (20
    tokens: mid second block) on the same prompts."""
    from tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        for family in EXTRA_FAMILIES:
            rng = random.Random(seed)
            prompts = [[rng.randrange(2, 512) for _ in range(rng.randint(20, 300))] for _ in range(4)]
            yield family, make_tiny_checkpoint(family, Path(tmp) / family), prompts
            if family == "mixtral":
                yield "mixtral window 20", make_tiny_checkpoint(family, Path(tmp) / "mixtral-20", sliding_window=20), prompts


def transformers_reads_swiglu_limit() -> bool:
    """Whether the installed transformers takes gpt-oss's SwiGLU clamp from the config: 5.17 (the
    GPU image's) hard-codes alpha 1.702 and limit 7.0, later versions read `swiglu_alpha/limit`.
    The engine reads the config, so the tiny checkpoint's limit 2.0 (which makes the clamp bite at
    random weights) gave other tokens than 5.17 on every prompt: 0/4 on 2026-12-01, tied routers
    or not. With an older transformers the reference rows use gpt-oss's released values."""
    import inspect

    from transformers.models.gpt_oss import modeling_gpt_oss

    return "config.swiglu_limit" in inspect.getsource(modeling_gpt_oss.GptOssExperts.__init__)


def transformers_greedy(path: Path, prompts: list[list[int]], device: str, n: int = 32) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(tokens[0, len(prompt):].tolist())
    return out


CPU_REFERENCE = ("gpt_oss",)
"""Families whose transformers reference runs on the CPU: on CUDA transformers 5.x takes gpt-oss
through another experts path (`batched_mm`; an MXFP4 checkpoint dequantizes to bf16 there and
fails in float32), which gives other tokens than its own CPU path; the engine's GPU is held to
transformers' CPU path, and the CUDA path's agreement is reported beside it."""


def check_families() -> Iterator[tuple[str, bool, str]]:
    """Issue 18's families, float32: the GPU (eager and CUDA graphs) gives transformers' greedy
    tokens on the GPU, 4 agents batched; the tiny MoE models with their tied router rows, so that
    the fused routing kernel must break ties as transformers' torch.topk does on CUDA.
    FAMILIES_ONLY=gpt_oss (a comma list) runs only those."""
    only = os.environ.get("FAMILIES_ONLY")
    for arch, path, prompts in family_cases():
        if only and arch.split()[0] not in only.split(","):
            continue
        if "mxfp4" in arch:  # transformers runs MXFP4 experts in bf16 (and fails in float32 on CUDA):
            # the float32 reference is the engine on the CPU (torch references, equal to
            # transformers on the CPU tests' checkpoints), the row GPU kernels == CPU references
            yield from gpu_equals_cpu(path, prompts, f"fp32 {arch} vs the engine on the cpu")
            continue
        on_cpu = arch.split()[0] in CPU_REFERENCE
        want = transformers_greedy(path, prompts, "cpu" if on_cpu else "cuda")
        if on_cpu:
            try:
                cuda = transformers_greedy(path, prompts, "cuda")
                detail = f"{sum(a == b for a, b in zip(cuda, want))}/4 agents equal"
            except Exception as exc:  # noqa: BLE001  a reference row: report, do not fail
                detail = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
            yield (f"reference: transformers {arch} cuda vs cpu", True, detail)
        for graphs in (False, True):
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False,
                                        cuda_graphs=graphs) as gpu:
                got = batched_greedy(gpu, prompts, 32)
            same = sum(a == b for a, b in zip(got, want))
            where = "cpu" if on_cpu else "cuda"
            yield (f"fp32 {arch} vs transformers ({where}) graphs={graphs}", same == len(prompts),
                   f"{same}/4 agents equal")
        if arch.split()[0] in HYBRIDS:  # verify steps: eager, and graphs with front-padded sequences
            yield from hybrid_speculation(arch, path, prompts, want, where)


HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def hybrid_speculation(arch: str, path: Path, prompts: list[list[int]], first: list[list[int]],
                       where: str) -> Iterator[tuple[str, bool, str]]:
    """A hybrid model's verify steps against transformers: histories that repeat themselves (the
    drafters find the continuation), mixed drafters and draft lengths, graphs off and on (verify
    graphs: each sequence front-padded, the padding left out of the linear layers, the commit
    reading the verify stash)."""
    prompts = [p + f + p for p, f in zip(prompts, first)]
    want = transformers_greedy(path, prompts, where)
    for graphs in (False, True):
        with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, cuda_graphs=graphs) as gpu:
            got = batched_greedy(gpu, prompts, 32, MIXED_SPECULATION)
            stats = gpu.stats()
            verify_graphs = 0 if gpu.core.runner.graphs is None else len(gpu.core.runner.graphs.verified)
        same = sum(a == b for a, b in zip(got, want))
        yield (f"spec fp32 {arch} vs transformers ({where}) graphs={graphs}",
               same == len(prompts) and stats.draft_tokens_accepted > 0 and (verify_graphs > 0) == graphs,
               f"{same}/4 agents equal; {stats.draft_tokens_accepted}/{stats.draft_tokens_proposed} drafts accepted "
               f"in {stats.verify_steps} verify steps; {verify_graphs} verify graphs")
        # the hybrid as its own draft model: its states a token short of each history, the drafting
        # steps on scratch copies (decode graphs of the draft's own), nearly every draft kept
        spec = {"method": "draft_model", "draft_model": str(path), "k": 4}
        with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, cuda_graphs=graphs,
                                    speculation=spec) as gpu:
            got = batched_greedy(gpu, prompts, 32)
            stats = gpu.stats()
        same = sum(a == b for a, b in zip(got, want))
        yield (f"hybrid draft model fp32 {arch} vs transformers ({where}) graphs={graphs}",
               same == len(prompts) and stats.draft_tokens_accepted >= 0.9 * stats.draft_tokens_proposed > 0,
               f"{same}/4 agents equal; {stats.draft_tokens_accepted}/{stats.draft_tokens_proposed} drafts accepted")


def check_logprobs() -> Iterator[tuple[str, bool, str]]:
    """The sampler's log-probabilities copied back from the GPU, against transformers on the GPU:
    per position the chosen token's logprob and the top 5 (ids in order, values within 1e-3)."""
    from transformers import AutoModelForCausalLM

    for arch, path, prompts in tiny_cases(("qwen3", "llama"), 31, max_prompt=120):
        prompts = [p + p[:40] for p in prompts]          # repeats: suffix drafts get accepted
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        wanted = (SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=5),
                  SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=5),
                  SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True, temperature=0.8, seed=3),
                  SamplingParams(max_tokens=24, ignore_eos=True))
        for graphs, spec in ((False, "off"), (True, "off"), (True, {"method": "suffix", "k": 4})):
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False,
                                        cuda_graphs=graphs) as gpu:
                results = [None] * 4

                def run(i: int) -> None:
                    params = dataclasses.replace(wanted[i], speculation=spec)
                    results[i] = gpu.open_state(f"lp{i}").generate(params, prompt=prompts[i])

                in_threads(run, 4)
                plain = batched_greedy(gpu, prompts, 24, specs=[spec], prefix="plain")
            worst, problems = 0.0, []
            for i, result in enumerate(results):
                if wanted[i].logprobs is False:
                    if result.logprobs is not None or list(result.token_ids) != plain[i]:
                        problems.append(f"agent {i} without logprobs changed")
                    continue
                if wanted[i].temperature == 0.0 and list(result.token_ids) != plain[i]:
                    problems.append(f"agent {i}: asking for logprobs changed its greedy tokens")
                if [lp.token_id for lp in result.logprobs] != list(result.token_ids):
                    problems.append(f"agent {i}: logprobs not of the chosen tokens")
                    continue
                history = list(prompts[i])
                with torch.inference_mode():
                    ids = torch.tensor([history + list(result.token_ids)], device="cuda")
                    logits = hf(ids).logits[0, len(history) - 1:-1].float().log_softmax(dim=-1)
                for pos, lp in enumerate(result.logprobs):
                    ref = logits[pos]
                    worst = max(worst, abs(lp.logprob - float(ref[lp.token_id])))
                    if wanted[i].top_logprobs:
                        # the top 5's values in order, each id's own value: near-ties may swap ids
                        values = ref.topk(5).values.tolist()
                        if len(lp.top) != 5:
                            problems.append(f"agent {i} position {pos}: {len(lp.top)} alternatives")
                            continue
                        worst = max([worst] + [abs(v - w) for (_, v), w in zip(lp.top, values)]
                                    + [abs(v - float(ref[t])) for t, v in lp.top])
            ok = not problems and worst < 1e-3
            yield (f"logprobs fp32 {arch} graphs={graphs} spec={spec if spec == 'off' else 'suffix k4'}", ok,
                   f"max |logprob - transformers| {worst:.2e}" + (f"; {problems[:3]}" if problems else ""))
        del hf
        torch.cuda.empty_cache()


def check_logit_bias() -> Iterator[tuple[str, bool, str]]:
    """`SamplingParams.logit_bias` on the GPU sampler, float32, 4 agents batched (eager and CUDA
    graphs, speculation off, suffix k=4 and the target as its own draft model, whose drafts carry the
    bias too): the two greedy agents with a bias (the unbiased reply's
    tokens banned, others favoured) give transformers' generate with the same `sequence_bias` on the
    GPU, the greedy agent without one its own unbiased tokens, and the sampled agent never draws a
    banned token."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    for arch, path, prompts in tiny_cases(("qwen3", "llama"), 37, max_prompt=120):
        prompts = [p + p[:40] for p in prompts]  # repeats: suffix drafts get accepted
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()

        def hf_greedy(prompt: list[int], bias: dict[int, float] | None, hf=hf) -> list[int]:
            config = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0,
                                      sequence_bias={(t,): v for t, v in (bias or {}).items()} or None)
            with torch.inference_mode():
                ids = torch.tensor([prompt], device="cuda")
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            return out[0, len(prompt):].tolist()

        plain = [hf_greedy(p, None) for p in prompts]
        biases = [{plain[0][0]: -100.0, plain[0][5]: -100.0, prompts[0][3]: 3.0},
                  {plain[1][2]: -100.0, 7: 6.0},
                  None,
                  {t: -100.0 for t in plain[3][:8]}]
        want = [hf_greedy(p, b) for p, b in zip(prompts[:2], biases[:2])] + [plain[2]]
        draft = {"method": "draft_model", "draft_model": str(path), "k": 4}  # the target drafting for itself
        for graphs, spec in ((False, "off"), (True, "off"), (True, {"method": "suffix", "k": 4}), (True, draft)):
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, cuda_graphs=graphs,
                                        **({"speculation": draft} if spec is draft else {})) as gpu:
                results: list = [None] * 4

                def run(i: int) -> None:
                    sampled = {"temperature": 1.0, "seed": 5} if i == 3 else {}
                    params = SamplingParams(max_tokens=24, ignore_eos=True, logit_bias=biases[i],
                                            speculation=None if spec is draft else spec, **sampled)
                    results[i] = list(gpu.open_state(f"b{i}").generate(params, prompt=prompts[i]).token_ids)

                in_threads(run, 4)
                stats = gpu.stats()
            same = sum(results[i] == want[i] for i in range(3))
            banned = sum(t in biases[3] for t in results[3])
            named = spec if spec == "off" else "draft model k4" if spec is draft else "suffix k4"
            yield (f"logit_bias fp32 {arch} graphs={graphs} spec={named}",
                   same == 3 and banned == 0 and want[0] != plain[0],
                   f"{same}/3 greedy agents == transformers; the sampled agent drew {banned} banned tokens; "
                   f"{stats.draft_tokens_accepted}/{stats.draft_tokens_proposed} drafts kept")
        del hf
        torch.cuda.empty_cache()


def check_window_pass() -> Iterator[tuple[str, bool, str]]:
    """The window surgery pass (sink + window attention, the Triton kernels' sink-token loops):
    the GPU, graphs off and on, 4 agents batched, gives the CPU reference's greedy tokens; the
    layers named (a ranking on each device could pick others), a window shorter than most
    prompts, sinks reaching into the second block. gpt_oss mixes them with its own windows and
    attention sinks."""
    surgery = [{"name": "window", "window": 24, "sink_tokens": 20, "layers": [1]}]
    for arch, path, prompts in tiny_cases(("llama", "qwen3", "gpt_oss"), 13):
        options = dict(progress=False, surgery=surgery, surgery_guard=False, speculation="off")
        with Engine.from_pretrained(path, device="cpu", **options) as cpu:
            want = batched_greedy(cpu, prompts, 32)
        for graphs in (False, True):
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", cuda_graphs=graphs, **options) as gpu:
                got = batched_greedy(gpu, prompts, 32)
            same = sum(a == b for a, b in zip(got, want))
            yield (f"window pass fp32 {arch} graphs={graphs}", same == len(prompts), f"{same}/4 agents equal")


def tool_loops(engine: Engine, prompts: list[list[int]], turns: int, seed: int) -> list[list[list[int]]]:
    """Agents (threads) in tool loops: each turn a greedy generation of 12 tokens, the chat
    layer's word that it called tools, a tool wait of 20-100 ms and a tool result of 4 tokens;
    agent i takes `turns + i % 2` turns, then closes its state (its blocks free for the others).
    Per agent, per turn, the tokens generated."""
    out: list[list[list[int]]] = [[] for _ in prompts]

    def run(i: int) -> None:
        rng = random.Random(seed + i)
        h, history = engine.open_state(f"tool{i}"), list(prompts[i])
        for _ in range(turns + i % 2):
            done = h.generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=history)
            out[i].append(list(done.token_ids))
            engine.registry.note_turn(h, called_tools=True)
            time.sleep(rng.uniform(0.02, 0.1))
            history += list(done.token_ids) + [rng.randrange(2, 512) for _ in range(4)]
        h.close()

    in_threads(run, len(prompts))
    return out


def check_tiers() -> Iterator[tuple[str, bool, str]]:
    """Issue 17's host tier on the GPU, its copies on a side stream (kv/transfers.py): 8 agents
    in tool loops under kv_device_blocks for about two of them park, resume and are prefetched
    between steps; their greedy tokens equal the same loops with the device KV unbounded, float32,
    CUDA graphs off and on (gemma3: sliding-window layer groups, copied page by page)."""
    for arch, path, _ in tiny_cases(("llama", "qwen3", "gemma3"), 17):
        rng = random.Random(17)
        prompts = [[rng.randrange(2, 512) for _ in range(rng.randint(40, 120))] for _ in range(8)]
        with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, speculation="off") as gpu:
            want = tool_loops(gpu, prompts, 4, 17)
        for graphs in (False, True):
            with Engine.from_pretrained(path, device="cuda", kv_device_blocks=26, dtype="float32", progress=False,
                                        cuda_graphs=graphs, speculation="off") as gpu:
                got = tool_loops(gpu, prompts, 4, 17)
                torch.cuda.synchronize()
                tier = gpu.stats().host_tier
            same = sum(a == b for a, b in zip(got, want))
            moved = tier["parks"] > 0 and tier["resumes"] > 0
            yield (f"tiers fp32 {arch} graphs={graphs}", same == len(prompts) and moved,
                   f"{same}/8 agents equal; parks {tier['parks']}, resumes {tier['resumes']}, prefetches "
                   f"{tier['prefetches']}, {tier['bytes_moved'] / 1e6:.1f} MB in {tier['seconds'] * 1e3:.1f} ms")


GRAMMAR_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "count", "tags"]}


def check_grammar(seed: int = 17) -> Iterator[tuple[str, bool, str]]:
    """Constrained and free agents in one batch on the GPU == the CPU; free agents == alone."""
    import json

    try:
        import xgrammar  # noqa: F401
    except ImportError:
        yield "grammar", False, "xgrammar is not installed here (carry its wheels: bench/README.md)"
        return
    for arch, path, prompts in tiny_cases(("qwen3", "llama"), seed, max_prompt=80):
        prompts = prompts + [p[::-1] for p in prompts]  # 8 agents
        wanted = [SamplingParams(max_tokens=96, json_schema=GRAMMAR_SCHEMA) if i % 2 == 0 else
                  SamplingParams(max_tokens=48, ignore_eos=True) for i in range(8)]

        def run_all(engine: Engine, spec, only=None) -> list:
            results = [None] * 8

            def run(i: int) -> None:
                if only is None or i in only:
                    params = dataclasses.replace(wanted[i], speculation=spec)
                    results[i] = engine.open_state(f"g{i}").generate(params, prompt=prompts[i])

            in_threads(run, 8)
            return results

        with Engine.from_pretrained(path, device="cpu", progress=False) as cpu:
            want = [list(r.token_ids) for r in run_all(cpu, "off")]
        for graphs, spec in ((False, "off"), (True, "off"), (True, {"method": "suffix", "k": 4})):
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, cuda_graphs=graphs) as gpu:
                got = run_all(gpu, spec)
                alone = {i: list(gpu.open_state(f"alone{i}").generate(
                    dataclasses.replace(wanted[i], speculation=spec), prompt=prompts[i]).token_ids) for i in (1, 5)}
            problems = [f"agent {i}: GPU != CPU" for i in range(8) if list(got[i].token_ids) != want[i]]
            problems += [f"free agent {i} changed beside constrained ones" for i in alone
                         if alone[i] != list(got[i].token_ids)]
            for i in range(0, 8, 2):
                if got[i].finish_reason == "stop":
                    try:
                        value = json.loads(got[i].text)
                        assert set(value) == {"name", "count", "tags"} and isinstance(value["count"], int)
                    except (ValueError, AssertionError):
                        problems.append(f"agent {i}: {got[i].text!r:.80} is not JSON of the schema")
            ended = sum(got[i].finish_reason == "stop" for i in range(0, 8, 2))
            yield (f"grammar {arch} graphs={graphs} spec={spec if isinstance(spec, str) else 'suffix4'}",
                   not problems, "; ".join(problems) or f"8/8 agents equal, {ended}/4 constrained ended as JSON")


def policies_agree(archs: tuple[str, ...], seed: int, policies: tuple, label: str) -> Iterator[tuple[str, bool, str]]:
    """Each tiny architecture in bf16, batch-1 decode graphs, one prompt at a time, under two
    fusion policies ((name, policy), (name, policy)): the same greedy tokens for 3 of 4 prompts at
    least (a near-tie may part them; the first difference is reported, under the policies' names)."""
    from hibana_kernels import fusion

    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for arch, path, prompts in tiny_cases(archs, seed):
        runs = []
        for _, policy in policies:
            with fusion.using(policy), Engine.from_pretrained(path, **ON_GPU, dtype="bfloat16", progress=False,
                                                              speculation="off") as engine:
                runs.append([list(engine.open_state(f"one{i}").generate(params, prompt=p).token_ids)
                             for i, p in enumerate(prompts)])
        firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 32) for x, y in zip(*runs)]
        same = sum(f == 32 for f in firsts)
        yield (f"bf16 {arch} {label}", same >= len(prompts) - 1,
               f"{policies[0][0]} vs {policies[1][0]}: {same}/{len(prompts)} prompts equal; "
               f"first difference at {firsts}")


def check_moe_fusion() -> Iterator[tuple[str, bool, str]]:
    """The sparse block's norm, router and top-k in one launch (fusion `moe_norm_route`) against
    the three kernels (its logits are float32 sums in the GEMV's order, rounded to bf16 as the
    GEMV's; a near-tie of two experts may still part them)."""
    from hibana_kernels import fusion

    yield from policies_agree(("qwen3_moe", "gpt_oss"), 41,
                              (("1 launch", dataclasses.replace(fusion.AUTO, moe_norm_route=True)),
                               ("3 launches", fusion.AUTO)), "moe_norm_route")


def check_unit_offset_fold() -> Iterator[tuple[str, bool, str]]:
    """Gemma's norm (by 1 + weight) folded into the GEMV after it (`rms_norm_linear`'s
    unit_offset) against the separate norm and GEMV (fusion off), on the families whose norms
    are Gemma's."""
    from hibana_kernels import fusion

    yield from policies_agree(("qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma3"), 43,
                              (("folded", fusion.AUTO), ("separate", fusion.OFF)), "Gemma's norm")


def check_moe_a8() -> Iterator[tuple[str, bool, str]]:
    """MXFP4 experts against int8 x (`DecodeTiles.a8`, the default decode tiles since 2026-12-04)
    beside the float GEMV on 16-bit x, bf16, batch-1 decode graphs, one prompt at a time: x and
    the activations rounded to 8 bits a block of 32 (0.5% of a layer's output) may part two
    near-tied tokens, so the first difference is reported; a broken kernel parts them at the
    first decoded token. Passes when every prompt's first decoded token agrees and at least half
    the prompts agree throughout."""
    from hibana_kernels import moe_triton, quant_triton

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    quantized = {"launches": 0}  # the a8 path really ran: its x quantize launches (counted at capture)
    original = quant_triton.quantize_a8

    def counted(*args, **kwargs):
        quantized["launches"] += 1
        return original(*args, **kwargs)

    a8 = moe_triton.DECODE_TILES["mxfp4"]
    float_tiles = a8._replace(block_n=8, block_k=256, num_warps=1, a8=False)
    quant_triton.quantize_a8 = counted
    try:
        for _, path, prompts in (case for case in family_cases() if case[0] == "gpt_oss untied mxfp4"):
            runs = {}
            for name, tiles in (("a8", a8), ("float", float_tiles)):
                with moe_triton.using_decode_tiles("mxfp4", tiles), Engine.from_pretrained(
                        path, **ON_GPU, dtype="bfloat16", progress=False, speculation="off") as engine:
                    runs[name] = [list(engine.open_state(f"one{i}").generate(params, prompt=p).token_ids)
                                  for i, p in enumerate(prompts)]
            firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 24)
                      for x, y in zip(runs["a8"], runs["float"])]
            ok = a8.a8 and quantized["launches"] > 0 and min(firsts) >= 2 and 2 * sum(f == 24 for f in firsts) >= len(firsts)
            yield ("bf16 gpt_oss mxfp4 experts: int8 x vs 16-bit x", ok,
                   f"first difference at {firsts} (24: none); x quantize launches {quantized['launches']}")
    finally:
        quant_triton.quantize_a8 = original


def check_moe_folds() -> Iterator[tuple[str, bool, str]]:
    """The decode path's launch folds in a sparse block, bf16, batch-1 decode graphs, one prompt
    at a time: the down projection summing a token's routes itself (`Fusion.moe_combine`) and, for
    MXFP4 experts, the norm writing x's int8 codes (`Fusion.a8_fold`: `fused_moe_a8`) give the
    tokens of the separate launches, every prompt throughout (the same sums of the same bits)."""
    import hibana_kernels as kernels
    from hibana_kernels import fusion

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    original, handed = kernels.fused_moe_a8, [0]  # the norm's codes really reached the experts

    def counted(*args, **kwargs):
        handed[0] += 1
        return original(*args, **kwargs)

    kernels.fused_moe_a8 = counted
    try:
        cases = (case for case in family_cases() if case[0] in ("qwen3_moe", "gpt_oss untied mxfp4"))
        for arch, path, prompts in cases:
            runs = []
            for policy in (dataclasses.replace(fusion.AUTO, a8_fold=True, moe_combine=True),
                           dataclasses.replace(fusion.AUTO, a8_fold=False, moe_combine=False)):
                with fusion.using(policy), Engine.from_pretrained(path, **ON_GPU, dtype="bfloat16", progress=False,
                                                                  speculation="off") as engine:
                    runs.append([list(engine.open_state(f"one{i}").generate(params, prompt=p).token_ids)
                                 for i, p in enumerate(prompts)])
            firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 24) for x, y in zip(*runs)]
            mxfp4 = "mxfp4" in arch
            yield (f"bf16 {arch} moe folds", all(f == 24 for f in firsts) and (handed[0] > 0 or not mxfp4),
                   f"folded vs separate: first difference at {firsts} (24: none); norm codes handed over "
                   f"{handed[0]} times")
    finally:
        kernels.fused_moe_a8 = original


def check_graph_capture() -> Iterator[tuple[str, bool, str]]:
    """CUDA graphs captured while another thread of the process pins host memory (what the host
    tier's warmer does; in torch's default capture mode that invalidates the capture), and a
    capture that fails (made to raise): the step runs without its graph, later steps capture
    again, the greedy tokens equal the CPU's, float32, 4 agents batched."""
    from hibana_core.runner import DecodeGraphs

    for arch, path, prompts in tiny_cases(("llama", "gemma3"), 23):
        with Engine.from_pretrained(path, device="cpu", dtype="float32", progress=False) as cpu:
            want = batched_greedy(cpu, prompts, 32)
        stop, pinned = threading.Event(), [0]

        def pin() -> None:
            while not stop.is_set():
                torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
                pinned[0] += 1

        pinner = threading.Thread(target=pin, daemon=True)
        pinner.start()
        try:
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, speculation="off") as gpu:
                got = batched_greedy(gpu, prompts, 32)
                graphs = len(gpu.core.runner.graphs.graphs)
        finally:
            stop.set()
            pinner.join()
        same = sum(a == b for a, b in zip(got, want))
        yield (f"graphs fp32 {arch} captured beside pinning", same == len(prompts) and graphs > 0,
               f"{same}/4 agents equal; {graphs} graphs, {pinned[0]} pinned allocations meanwhile")

        forward, failed = DecodeGraphs._forward, [0]

        def failing_forward(self, bucket, q, span):
            if torch.cuda.is_current_stream_capturing() and not failed[0]:
                failed[0] += 1  # a call a capture forbids: it raises, and the capture is dropped
                torch.cuda.synchronize()
            return forward(self, bucket, q, span)

        DecodeGraphs._forward = failing_forward
        try:
            with Engine.from_pretrained(path, **ON_GPU, dtype="float32", progress=False, speculation="off") as gpu:
                got = batched_greedy(gpu, prompts, 32)
                got += batched_greedy(gpu, prompts[:2], 8, prefix="again")
                graphs = len(gpu.core.runner.graphs.graphs)
        finally:
            DecodeGraphs._forward = forward
        with Engine.from_pretrained(path, device="cpu", dtype="float32", progress=False) as cpu:
            want += batched_greedy(cpu, prompts[:2], 8, prefix="again")
        same = sum(a == b for a, b in zip(got, want))
        yield (f"graphs fp32 {arch} after failed captures", same == len(want) and graphs > 0,
               f"{same}/{len(want)} runs equal; {failed[0]} captures failed, {graphs} graphs captured after")


CHECKS = {"float32": check_float32, "speculation": check_speculation, "surgery": check_surgery,
          "kv8": check_kv8, "fp8": check_fp8, "bf16": check_bf16_demo, "families": check_families,
          "logprobs": check_logprobs, "logit_bias": check_logit_bias, "window": check_window_pass, "shapes": check_shapes, "tiers": check_tiers,
          "grammar": check_grammar, "moe_fusion": check_moe_fusion, "graph_capture": check_graph_capture,
          "a8_fold": check_a8_fold, "moe_a8": check_moe_a8, "unit_offset_fold": check_unit_offset_fold,
          "moe_folds": check_moe_folds}


def main() -> int:
    """All checks, or those named by --only a,b (of CHECKS); --bf16-only is --only bf16."""
    names = list(CHECKS)
    if "--bf16-only" in sys.argv:
        names = ["bf16"]
    if "--kv8-only" in sys.argv:
        names = ["kv8"]
    if "--only" in sys.argv:
        names = sys.argv[sys.argv.index("--only") + 1].split(",")
        unknown = set(names) - set(CHECKS)
        if unknown:
            print(f"gpu_correctness: no check named {sorted(unknown)}; choose from {', '.join(CHECKS)}")
            return 2
    rows = []
    for check in names:  # each row as it comes: a run cut short still reports what it did
        start = time.perf_counter()
        for name, ok, detail in CHECKS[check]():
            print(f"{name:<48}  {'PASS' if ok else 'FAIL'}  {detail}  [{time.perf_counter() - start:.0f} s]",
                  flush=True)
            rows.append((name, ok, detail))
    return 0 if all(ok for _, ok, _ in rows) else 1

if __name__ == "__main__":
    sys.exit(main())
