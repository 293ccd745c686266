"""A third-party plugin, installed as a distribution with an entry point, that registers one of
each kind Hibana looks up by name, used end to end the way the README says: its model family
loads a checkpoint of a new model_type, its surgery pass runs through the engine and through
`hibana surgery --out` (the manifest read back), its chat format and tool parser serve
`Engine.chat`, its drafter is named per request."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from hibana_plugins.manager import get_plugin_manager, reset_plugin_manager

PLUGIN = '''
import json, re

from hibana_plugins import hookimpl
from hibana_plugins.hookspecs import ParsedOutput, ToolCall


class Family:
    def build(self, hf_config, ctx):
        from transformers import Qwen3Config
        from hibana_core.models import llama
        return llama.build(Qwen3Config(**{k: v for k, v in hf_config.to_dict().items() if k != "model_type"}), ctx)


class RoundMlp:
    def apply(self, model, params):
        import torch
        n = 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp." in name:
                    p.copy_(p.to(torch.bfloat16).to(p.dtype))
                    n += 1
        return {"layers": n, "bytes_before": 0, "bytes_after": 0}


class Parser:
    CALL = re.compile(r'<call name="([^"]+)">(.*?)</call>', re.S)

    def parse(self, text):
        calls = [ToolCall("call_" + "0" * 24, m.group(1), json.loads(m.group(2))) for m in self.CALL.finditer(text)]
        return ParsedOutput(self.CALL.sub("", str(text)).strip(), calls)

    def stream(self):
        raise NotImplementedError


class Format:
    template = ("{% if tools %}{{ tools | tojson }}\\n{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}\\n"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tool_parser = "acme_xml"


class Repeat:
    proposals = 0

    def __init__(self, engine):
        self.engine = engine

    def propose(self, state, k):
        Repeat.proposals += 1
        return [state.tokens[-1]] * k


@hookimpl
def register_model_families(register):
    register("acmeqwen", Family())


@hookimpl
def register_surgery_passes(register):
    register("acme_round", RoundMlp())


@hookimpl
def register_tool_parsers(register):
    register("acme_xml", Parser())


@hookimpl
def register_chat_formats(register):
    register("acmeqwen", Format())


@hookimpl
def register_drafters(register):
    register("acme_repeat", Repeat)
'''


@pytest.fixture
def acme(tmp_path, monkeypatch):
    """The plugin installed (a module and its dist-info on sys.path), and a tiny checkpoint of its
    model_type."""
    import tiny_models

    site = tmp_path / "site"
    site.mkdir()
    (site / "acme_hibana.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "acme_hibana-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-hibana\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[hibana]\nacme = acme_hibana\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("HIBANA_PLUGINS", raising=False)
    reset_plugin_manager()
    path = tiny_models.make_tiny_checkpoint("qwen3", tmp_path / "acmeqwen")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "acmeqwen"
    config.pop("architectures", None)
    (path / "config.json").write_text(json.dumps(config))
    yield path
    reset_plugin_manager()
    sys.modules.pop("acme_hibana", None)


def test_a_third_party_plugin_of_every_kind_end_to_end(acme, tmp_path, capsys):
    import tiny_models

    from hibana_core import SamplingParams
    from hibana_core.cli import main
    from hibana_core.errors import ConfigError, StateFileError

    rows = {(i.plugin, i.kind, i.name, i.package) for i in get_plugin_manager().describe()}
    assert {("acme", kind, name, "acme-hibana") for kind, name in [
        ("model_family", "acmeqwen"), ("surgery_pass", "acme_round"), ("tool_parser", "acme_xml"),
        ("chat_format", "acmeqwen"), ("drafter", "acme_repeat")]} <= rows
    assert get_plugin_manager().load_errors == []

    plain = tiny_models.open_engine(acme)
    with plain:
        handle = plain.open_state("a")
        handle.sync([1, 2, 3, 4])
        handle.save(tmp_path / "plain.state")
        spec = SamplingParams(max_tokens=6, temperature=0.0, speculation={"method": "acme_repeat", "k": 2})
        assert handle.generate(spec).token_ids
        assert sys.modules["acme_hibana"].Repeat.proposals > 0
        chat = plain.chat("c")
        assert (chat.parser_name, chat.template) == ("acme_xml", sys.modules["acme_hibana"].Format.template)

    rounded = tiny_models.open_engine(acme, surgery=["acme_round"])
    with rounded:
        assert [r["name"] for r in rounded.surgery] == ["acme_round"]
        with pytest.raises(StateFileError, match="surgery none .*acme_round"):
            rounded.load_state(tmp_path / "plain.state")  # the pass joins the fingerprint
        handle = rounded.open_state("r")
        handle.sync([1, 2, 3, 4])
        handle.save(tmp_path / "rounded.state")
        want = handle.generate(SamplingParams(max_tokens=6, temperature=0.0)).token_ids

    out = tmp_path / "out"
    assert main(["surgery", str(acme), "--passes", "acme_round", "--out", str(out), "--no-guard", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    assert "acme_round: 4 layers" in capsys.readouterr().out
    assert [r["name"] for r in json.loads((out / "hibana_surgery.json").read_text())["passes"]] == ["acme_round"]
    written = tiny_models.open_engine(out)
    with written:
        assert [r["name"] for r in written.surgery] == ["acme_round"]
        handle = written.load_state(tmp_path / "rounded.state")  # the engine that wrote it, as far as states go
        assert handle.generate(SamplingParams(max_tokens=6, temperature=0.0)).token_ids == want
    with pytest.raises(ConfigError, match="'acme_round' applied already"):
        tiny_models.open_engine(out, surgery=["acme_round"])
