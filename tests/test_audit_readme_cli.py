"""The commands' help says what the README says (options, defaults)."""

from __future__ import annotations


def test_dtype_help_says_what_auto_picks_for_a_float32_checkpoint():
    # the README and EngineConfig.dtype: 'auto' runs a float32 checkpoint in bfloat16 on a GPU;
    # `hibana surgery --help` and `hibana serve --help` said "the checkpoint's"
    from hibana_core.cli import build_parser as cli_parser
    from hibana_plugins.server import build_parser as serve_parser

    surgery = next(a for a in cli_parser()._subparsers._group_actions[0].choices["surgery"]._actions
                   if a.dest == "dtype")
    serve = next(a for a in serve_parser()._actions if a.dest == "dtype")
    for action in (surgery, serve):
        assert "bfloat16 for a float32 one" in action.help and "float32 on CPU" in action.help
