"""The constrained request that failed in the H200's batch-32 grammar run, on the CPU: a tiny random
qwen3 with a byte-level BPE of Qwen3's size, 32 agents under bench/grammar_overhead.py's schema.

    python bench/results/grammar_refused_token_repro.py async|sync TEMPERATURE REPEATS

Prints each request that failed and the count after each repeat."""
import sys, threading, time, random
import torch
from pathlib import Path
from transformers import Qwen3Config, Qwen3ForCausalLM, AutoTokenizer
BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from hibana_core import Engine, SamplingParams
from grammar_overhead import SCHEMA
from grammar_libs import build_big_tokenizer

tok_dir = build_big_tokenizer(BENCH / "out" / "qwen3-size-tokenizer")
tok = AutoTokenizer.from_pretrained(tok_dir)
out = BENCH / "out" / "grammar_repro_model"
if not out.exists():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=max(len(tok), 151936), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    m = Qwen3ForCausalLM(cfg)
    m.save_pretrained(out); tok.save_pretrained(out)
async_ = sys.argv[1] == "async"
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
eng = Engine.from_pretrained(str(out), device="cpu", dtype="float32", progress=False, speculation="off",
                             async_scheduling=async_)
errors = 0
rng = random.Random(0)
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    prompts = [[rng.randrange(10, 50000) for _ in range(64)] for _ in range(32)]
    params = SamplingParams(max_tokens=128, ignore_eos=True, json_schema=SCHEMA, temperature=temp, seed=None)
    res = [None] * 32
    def run(i):
        global errors
        h = eng.open_state(f"r{rep}-{i}")
        try:
            res[i] = h.generate(params, prompt=prompts[i])
        except Exception as e:
            errors += 1
            print("ERR", i, type(e).__name__, str(e)[:200], flush=True)
        h.close()
    ts = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    [t.start() for t in ts]; [t.join() for t in ts]
    print("rep", rep, "errors so far", errors, flush=True)
eng.close()
