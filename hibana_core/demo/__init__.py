"""The bundled demo agent model and the code that trains, evaluates and runs it.

    names.py     randomised tool and argument names, split between training and held-out use
    world.py     the data the tools answer from (cities, people, files, ...), derived from hashes
    tasks.py     tool families: JSON schemas, the Python functions behind them, questions, answers
    corpus.py    synthetic conversations, rendered with the chat template and tokenized
    template.py  the model's chat template (hermes / Qwen tool format) and a renderer
    train.py     `python -m hibana_core.demo.train`: corpus, tokenizer, model -> demo/model/
    evaluate.py  held-out evaluation (unseen tool and argument names)
    run.py       `hibana demo`: concurrent agents in real tool loops
"""
