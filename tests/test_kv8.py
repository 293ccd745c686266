"""kv8: the KV cache in fp8 (e4m3) with per-(layer, KV head) scales, as a surgery pass.

What is exact and what is not: fp8 keeps 3 mantissa bits, so kv8 output is not the full-precision
model's (on the trained demo model the guard measures ~97% teacher-forced top-1 agreement; the
tiny random test models, whose attention is far more sensitive, sit lower). What kv8 computes is
exact: transformers' own model with every key and value (after rotary) replaced by its fp8 round
trip under the engine's scales gives the same greedy tokens; and whatever reads the same fp8
cache (speculation, prefix reuse, forks, state files) gives the same tokens as without them.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from hibana_core import SamplingParams
from hibana_core.errors import ConfigError, StateFileError
from hibana_core.kv.cache import FP8
from hibana_core.surgery.passes import WeightQuantPass
from hibana_kernels import attention
from tiny_models import ARCHS, _no_stop_config, random_tokens


def greedy(n: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kwargs)


def kv8_engine(make_engine, path, **overrides):
    return make_engine(path, **{"surgery": ["kv8"], "surgery_guard": False, "speculation": "off", **overrides})


def scales_of(engine) -> list[torch.Tensor]:
    layers = sorted((m.layer_idx, m) for m in engine.model.modules() if hasattr(m, "set_kv_scales"))
    return [m.kv_scale for _, m in layers]


_SCALES: dict[str, list[torch.Tensor]] = {}


EAGER_ATTENTION = ("gpt_oss",)
"""Families whose attention sdpa cannot compute (gpt-oss's sinks): their own eager attention."""


def _fp8_round_trip(attend):
    """transformers' `attend` over keys and values replaced by their fp8 round trip (key, value:
    [1, H_kv, T, D], rotary applied; the whole cache each step: idempotent)."""

    def forward(module, query, key, value, attention_mask, **kwargs):
        scale = _SCALES["now"][module.layer_idx]

        def round_trip(x, s):
            x = x[0].transpose(0, 1)  # [T, H_kv, D]
            return attention.dequantize_kv(attention.quantize_kv(x, s), s, x.dtype).transpose(0, 1)[None]

        return attend(module, query, round_trip(key, scale[0]), round_trip(value, scale[1]), attention_mask, **kwargs)

    return forward


def _own_eager_attention(module, *args, **kwargs):
    import importlib

    return importlib.import_module(type(module).__module__).eager_attention_forward(module, *args, **kwargs)


def hf_fp8_kv_greedy(path, scales, prompt, n) -> list[int]:
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    eager = AutoConfig.from_pretrained(path).model_type in EAGER_ATTENTION
    name = "hibana_fp8_kv_eager" if eager else "hibana_fp8_kv"
    AttentionInterface.register(name, _fp8_round_trip(_own_eager_attention if eager else sdpa_attention_forward))
    AttentionMaskInterface.register(name, eager_mask if eager else sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name)
    model.generation_config = _no_stop_config(1)
    _SCALES["now"] = [s.cpu() for s in scales]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), generation_config=_no_stop_config(n))
    return out.sequences[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_kv8_computes_transformers_attention_over_fp8_round_tripped_kv(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    engine = kv8_engine(make_engine, path)
    record, = engine.surgery
    a = engine.model_args
    assert engine.kv_cache.dtype == FP8 and engine.kv_cache.data.element_size() == 1
    assert record["layers"] == a.num_layers and record["calibration"].startswith("calibration.txt")
    assert record["kv_bytes_per_token_after"] == 2 * a.num_layers * a.num_kv_heads * a.head_dim
    assert record["kv_bytes_per_token_before"] == 4 * record["kv_bytes_per_token_after"]  # float32 here
    for scale in scales_of(engine):  # powers of two: the read-back is exact in the compute dtype
        assert scale.shape == (2, a.num_kv_heads) and torch.equal(torch.log2(scale), torch.log2(scale).round())
    rng = random.Random(2)
    for turn in range(3):  # prefill, decode, and a later turn over retained blocks (mistral: past its window)
        h = engine.open_state(f"s{turn}")
        prompt = random_tokens(rng, 30 + 25 * turn)
        got = list(h.generate(greedy(), prompt=prompt).token_ids)
        assert got == hf_fp8_kv_greedy(path, scales_of(engine), prompt, len(got))
        more = random_tokens(rng, 9)
        got = list(h.generate(greedy(12), prompt=h.tokens + more).token_ids)
        assert got == hf_fp8_kv_greedy(path, scales_of(engine), h.tokens[:-12], 12)


def test_kv8_holds_twice_the_blocks_in_the_same_budget(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    budget = 24 << 20
    engines = {kv: make_engine(path, dtype="bfloat16", num_blocks=None, memory_budget=budget,
                               speculation="off", surgery_guard=False, surgery=["kv8"] if kv == "fp8" else [])
               for kv in ("bf16", "fp8")}
    bf16, fp8 = engines["bf16"], engines["fp8"]
    assert bf16.kv_cache.dtype == torch.bfloat16 and fp8.kv_cache.dtype == FP8
    assert fp8.weight_bytes - bf16.weight_bytes == 4 * 2 * fp8.model_args.num_layers * fp8.model_args.num_kv_heads
    ratio = fp8.pool.num_blocks / bf16.pool.num_blocks
    assert ratio == pytest.approx(2.0, abs=0.01), ratio  # (the scales' few bytes come out of the budget too)
    assert fp8.kv_cache.nbytes == pytest.approx(bf16.kv_cache.nbytes, rel=0.01)  # the same bytes, twice the blocks
    assert fp8.stats().kv_blocks_total == fp8.pool.num_blocks


def test_kv_dtype_fp8_is_the_kv8_pass(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["qwen3"]
    by_pass = kv8_engine(make_engine, path)
    for name in ("fp8", "float8_e4m3fn"):
        by_dtype = make_engine(path, kv_dtype=name, surgery_guard=False, speculation="off")
        assert [r["name"] for r in by_dtype.surgery] == ["kv8"] and by_dtype.kv_cache.dtype == FP8
        assert by_dtype.fingerprint == by_pass.fingerprint
    both = make_engine(path, kv_dtype="fp8", surgery=["w8"], surgery_guard=False, speculation="off")
    assert [r["name"] for r in both.surgery] == ["w8", "kv8"], "kv8 comes last, calibrated on the packed weights"
    with pytest.raises(ConfigError, match=r"kv8 stores the KV cache in fp8; kv_dtype='bfloat16'"):
        make_engine(path, kv_dtype="bfloat16", surgery=["kv8"])
    with pytest.raises(ConfigError, match=r"kv_dtype='float16' differs .*kv_dtype='fp8', the kv8 pass"):
        make_engine(path, kv_dtype="float16")
    with pytest.raises(ConfigError, match=r"kv_dtype must be auto, float32, bfloat16, float16 or fp8"):
        make_engine(path, kv_dtype="int8")
    with pytest.raises(ConfigError, match=r"kv8 takes no parameters"):
        make_engine(path, surgery=[{"name": "kv8", "margin": 4}], surgery_guard=False)


def test_kv8_state_files_round_trip_and_refuse_other_kv(tiny_checkpoints, make_engine, tmp_path, monkeypatch):
    path = tiny_checkpoints["qwen2"]
    prompt = random_tokens(random.Random(5), 45)
    engine = kv8_engine(make_engine, path)
    h = engine.open_state("a")
    h.generate(greedy(8), prompt=prompt)
    h.save(tmp_path / "fp8.hibana")
    blocks = engine.kv_cache.read_blocks(engine.registry._entries["a"].seq.block_ids)
    assert blocks.dtype == FP8

    again = kv8_engine(make_engine, path)  # a new engine calibrates the same scales
    assert again.fingerprint == engine.fingerprint
    loaded = again.load_state(tmp_path / "fp8.hibana")
    assert loaded.tokens == h.tokens
    restored = again.kv_cache.read_blocks(again.registry._entries["a"].seq.block_ids)
    assert torch.equal(restored.view(torch.uint8), blocks.view(torch.uint8)), "fp8 bytes restored exactly"
    stats = loaded.append([7, 8, 9])
    assert stats.reused == len(h.tokens) - 1 and stats.computed == 4  # (the last generated token had no KV yet)
    assert list(loaded.generate(greedy(10)).token_ids) == list(h.generate(greedy(10), prompt=h.tokens + [7, 8, 9]).token_ids)

    plain = make_engine(path, speculation="off")
    p = plain.open_state("a")
    p.generate(greedy(8), prompt=prompt)
    p.save(tmp_path / "fp32.hibana")
    with pytest.raises(StateFileError, match=r"kv_dtype float32 \(this engine: float8_e4m3fn\); surgery none "
                                              r"\(this engine: kv8\)"):
        engine.load_state(tmp_path / "fp32.hibana", "from-fp32")
    with pytest.raises(StateFileError, match=r"surgery kv8 \(this engine: none\)"):
        plain.load_state(tmp_path / "fp8.hibana", "from-fp8")
    bf16 = make_engine(path, dtype="bfloat16", speculation="off")
    b = bf16.open_state("a")
    b.generate(greedy(4), prompt=prompt)
    b.save(tmp_path / "bf16.hibana")
    with pytest.raises(StateFileError, match=r"dtype bfloat16 \(this engine: float32\)"):
        engine.load_state(tmp_path / "bf16.hibana", "from-bf16")

    from hibana_core.surgery.passes import KVQuantPass

    monkeypatch.setattr(KVQuantPass, "MARGIN", 64.0)  # other scales: the same bytes would mean other values
    other = kv8_engine(make_engine, path)
    assert other.fingerprint != engine.fingerprint
    with pytest.raises(StateFileError, match="the same passes, with other calibrated values .scales.: calibrated on other text"):
        other.load_state(tmp_path / "fp8.hibana", "other-scales")


def _batched(engine, prompts, n, specs):
    out = [None] * len(prompts)

    def run(i):
        out[i] = list(engine.open_state(f"p{i}").generate(greedy(n, speculation=specs[i % len(specs)]),
                                                          prompt=prompts[i]).token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_kv8_speculation_gives_the_tokens_of_no_speculation(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    off = kv8_engine(make_engine, path)
    rng = random.Random(13)
    prompts = [random_tokens(rng, rng.randint(20, 80)) for _ in range(4)]
    first = _batched(off, prompts, 40, ["off"])
    prompts = [p + f + p for p, f in zip(prompts, first)]  # histories that repeat: drafts accepted and rejected
    want = [list(off.open_state(f"w{i}").generate(greedy(40), prompt=p).token_ids) for i, p in enumerate(prompts)]
    on = kv8_engine(make_engine, path, speculation="adaptive")
    got = _batched(on, prompts, 40, [{"method": "suffix", "k": 4}, "adaptive", {"method": "ngram", "k": 2},
                                     {"method": "suffix", "k": 8}])
    assert got == want
    stats = on.stats()
    assert stats.draft_tokens_accepted > 0 and stats.draft_tokens_accepted < stats.draft_tokens_proposed


def test_kv8_layer_skip_drafts_on_an_fp8_cache_of_its_own(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["qwen3"]
    off = kv8_engine(make_engine, path)
    on = kv8_engine(make_engine, path, speculation={"method": "layer_skip", "k": 3})
    prompt = random_tokens(random.Random(4), 40) * 2
    assert list(on.open_state("a").generate(greedy(30), prompt=prompt).token_ids) == \
        list(off.open_state("a").generate(greedy(30), prompt=prompt).token_ids)
    drafter = on.scheduler.speculation.drafter("layer_skip")
    assert drafter.kv_cache.dtype == FP8 and on.stats().draft_tokens_proposed > 0


def test_kv8_prefix_sharing_and_forks_read_the_same_fp8_blocks(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    shared = kv8_engine(make_engine, path)
    fresh = kv8_engine(make_engine, path, enable_prefix_caching=False)
    rng = random.Random(21)
    system, a_turn, b_turn = random_tokens(rng, 70), random_tokens(rng, 11), random_tokens(rng, 23)
    a = shared.open_state("a")
    a.generate(greedy(12), prompt=system + a_turn)
    b = shared.open_state("b")
    stats = b.sync(system + b_turn)
    assert stats.reused >= 64, "full blocks of the shared prefix are reused"
    got = list(b.generate(greedy()).token_ids)
    assert got == list(fresh.open_state("b").generate(greedy(), prompt=system + b_turn).token_ids)
    fork = a.fork("a2")
    assert list(fork.generate(greedy(16)).token_ids) == list(a.generate(greedy(16)).token_ids)
    a.truncate(50)  # a rollback, as rejected drafts are rolled back
    assert list(a.generate(greedy(16)).token_ids) == \
        list(fresh.open_state("t").generate(greedy(16), prompt=fork.tokens[:50]).token_ids)


def test_w8_and_kv8_together_and_written_to_a_checkpoint(tiny_checkpoints, make_engine, tmp_path, capsys):
    from hibana_core.cli import main

    path, out = tiny_checkpoints["qwen3"], tmp_path / "out"
    direct = make_engine(path, surgery=["w8", "kv8"], surgery_guard=False, speculation="off")
    assert [r["name"] for r in direct.surgery] == ["w8", "kv8"] and direct.kv_cache.dtype == FP8
    assert {m.kind for n, m in direct.model.named_modules() if hasattr(m, "set_packed") and "lm_head" not in n} == {"int8"}
    w8 = make_engine(path, surgery=["w8"], surgery_guard=False, speculation="off")
    assert direct.fingerprint != w8.fingerprint

    assert main(["surgery", str(path), "--passes", "w8,kv8", "--out", str(out), "--no-guard", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "kv8: 2 layers, KV bytes per token" in printed and "wrote" in printed
    saved = make_engine(out, speculation="off")
    assert [r["name"] for r in saved.surgery] == ["w8", "kv8"] and saved.kv_cache.dtype == FP8
    assert [r["digest"] for r in saved.surgery[1:]] == [direct.surgery[1]["digest"]]
    assert all(torch.equal(x, y) for x, y in zip(scales_of(saved), scales_of(direct)))
    prompt = random_tokens(random.Random(9), 33)
    assert list(saved.open_state("a").generate(greedy(), prompt=prompt).token_ids) == \
        list(direct.open_state("a").generate(greedy(), prompt=prompt).token_ids)
    # kv_dtype="fp8" asks for what the checkpoint has: its engine; kv8 named again is refused
    again = make_engine(out, speculation="off", kv_dtype="fp8")
    assert again.fingerprint == saved.fingerprint and again.kv_cache.dtype == FP8
    with pytest.raises(ConfigError, match="already stores its KV cache in fp8"):
        make_engine(out, surgery=["kv8"])


def test_kv8_without_a_tokenizer_calibrates_on_random_tokens():
    from transformers import AutoModelForCausalLM

    from hibana_core import Engine
    from tiny_models import make_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_config("llama"))
    with Engine.from_hf_model(hf, device="cpu", dtype="float32", num_blocks=32, progress=False,
                              speculation="off", surgery=["kv8"], surgery_guard=False) as engine:
        assert engine.surgery[0]["calibration"].startswith("random tokens")
        assert engine.kv_cache.dtype == FP8
        assert len(engine.open_state("a").generate(greedy(5), prompt=[1, 2, 3]).token_ids) == 5


def test_the_guard_measures_kv8_on_an_fp8_scratch_cache(tiny_checkpoints, make_engine):
    """The guard's scorer follows the model's KV dtype: after kv8 it stores and reads fp8 (the
    kernels refuse scales with a float cache, so a float scratch cache could not run at all);
    on a tiny random model kv8 is over its floors, so forced here."""
    engine = make_engine(tiny_checkpoints["llama"], surgery=[{"name": "kv8", "force": True}], speculation="off")
    guard = engine.surgery[0]["guard"]
    assert guard["floors"] == {"ppl_ratio": 1.02, "top1_agreement": 0.95}
    assert 0 < guard["mean_kl"] < 0.1 and 0.5 < guard["top1_agreement"] < 1.0
    with pytest.raises(ValueError, match="needs kv_scale"):
        attention.store_kv(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 16, 1, 4, dtype=FP8),
                           torch.zeros(1, 16, 1, 4, dtype=FP8), torch.tensor([0]))
    with pytest.raises(ValueError, match="takes no kv_scale"):
        attention.store_kv(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 16, 1, 4),
                           torch.zeros(1, 16, 1, 4), torch.tensor([0]), torch.ones(2, 1))


def test_surgery_checks_its_out_directory_before_loading(tmp_path, capsys, monkeypatch):
    """A file, a directory with files in it, or one that cannot be made is refused before the
    model loads (it was after loading, surgery and the guard; an unwritable path raised a
    FileNotFoundError); a comma-separated string for surgery= says to give a list."""
    import hibana_core

    from hibana_core.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("loaded before checking --out")
    monkeypatch.setattr(hibana_core.Engine, "from_pretrained", no_load)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    for out, said in (("afile", "is a file"), ("full", "is not empty")):
        assert main(["surgery", "demo", "--passes", "w8", "--out", str(tmp_path / out), "--no-guard"]) == 2  # a usage error
        assert said in capsys.readouterr().err
    blocked = tmp_path / "afile" / "sub"  # under a file: cannot be made
    assert main(["surgery", "demo", "--passes", "w8", "--out", str(blocked), "--no-guard"]) == 2
    assert "cannot make the directory" in capsys.readouterr().err
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r'give a list: surgery=\["w8", "kv8"\]'):
        hibana_core.Engine.from_pretrained("demo", surgery="w8,kv8", progress=False)


def test_a_second_weight_pass_says_the_layers_are_packed_already(tiny_checkpoints, make_engine):
    """w8 then w4 (or w4 on a checkpoint written by w8) said it "found no linear layer it can pack"."""
    path = tiny_checkpoints["qwen3"]
    for first, second in (("w8", "w4"), ("w4", "w8")):  # in one list: refused before the model loads
        with pytest.raises(ConfigError, match=f"passes '{first}' and '{second}' both rewrite the linear weights"):
            make_engine(path, surgery=[first, second], surgery_guard=False, speculation="off")
    packed = make_engine(path, surgery=["w8"], surgery_guard=False, speculation="off")
    with pytest.raises(ConfigError, match="the linear layers are already int8"):
        WeightQuantPass(4).refuse(packed.model, {})


def test_w4_records_the_group_sizes_it_used(tiny_checkpoints, make_engine):
    """A group size that divides no layer's inputs is replaced per layer by one that does: the
    record says which (it said group_size 4096 alone)."""
    engine = make_engine(tiny_checkpoints["qwen3"], surgery=[{"name": "w4", "group_size": 4096}],
                         surgery_guard=False, speculation="off")
    record = engine.surgery[0]
    assert record["params"]["group_size"] == 4096 and record["group_sizes_used"]
    assert 4096 not in record["group_sizes_used"]


def test_a_pass_that_cannot_apply_is_refused_before_the_guard_measures(tiny_checkpoints, make_engine, tmp_path,
                                                                      monkeypatch):
    """w8 on a checkpoint written by w8, kv8 on one written by kv8 and window on named layers the
    model lacks are refused before the guard measures the unmodified model (minutes on a large
    model on a CPU: the refusal came after them); the guard still measures before any pass runs."""
    from hibana_core.cli import main
    from hibana_core.surgery import guard

    path = tiny_checkpoints["qwen3"]
    out = tmp_path / "w8kv8"
    assert main(["surgery", str(path), "--passes", "w8,kv8", "--out", str(out), "--no-guard", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    measured = []
    real = guard.measure_reference
    monkeypatch.setattr(guard, "measure_reference", lambda *a, **k: measured.append(1) or real(*a, **k))
    for passes, said in ((["w8"], "the linear layers are already int8"),
                         (["kv8"], "already stores its KV cache in fp8"),
                         (["w8", {"name": "window", "layers": [0, 7]}], r"window: layers \[7\] are not full-attention")):
        with pytest.raises(ConfigError, match=said):
            make_engine(out if passes != ["w8", {"name": "window", "layers": [0, 7]}] else path, surgery=passes,
                        speculation="off")
        assert not measured, passes
    engine = make_engine(path, surgery=[{"name": "w8", "force": True}], speculation="off")
    assert measured == [1] and engine.surgery[0]["guard"]["tokens"] > 0
