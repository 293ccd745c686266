"""The bundled demo agent model and the code that trains, evaluates and runs it.

    names.py     randomised tool and argument names, split between training and held-out use
    world.py     the data the tools answer from (cities, people, files, ...), derived from hashes
    tools.py     tool families: randomised JSON schemas and the Python functions behind them
    tasks.py     a question, the tool calls that solve it, the answer that quotes the results
    corpus.py    synthetic conversations: tools, tasks, chained and parallel calls, chit-chat
    tools_v2.py  corpus v2's natural tools (many domains, several argument types)
    corpus_v2.py corpus v2: natural-tool conversations, run 3's corpus mixed in (train --corpus v2)
    tools_v3.py  corpus v3's open world: open values, open tools, v2's specs with their pools reopened
    corpus_v3.py corpus v3: v2's conversations over the open world (train --corpus v3)
    template.py  the model's chat template (hermes / Qwen tool format) and a renderer
    tokenizer.py byte-level BPE trained on the corpus
    train.py     `python -m hibana_core.demo.train`: corpus, tokenizer, model -> demo/model/
    evaluate.py  held-out evaluation (unseen tool and argument names; --set v2: heldout_v2.py)
    heldout_v2.py the independent held-out set of issue 15: other domains, other phrasing
    perturb.py   corpus v2 first calls with unseen values / tool names / argument names (--set perturbed)
    run.py       `hibana demo`: concurrent agents in real tool loops
"""
