"""`sgl serve` flags come from the ServerArgs fields: every field has its flag and
its help text, values are typed, choices come from Literal fields, list fields
take several values, bad values name the field; `sgl serve MODEL` is
--model-path MODEL; `sgl --version`."""

from __future__ import annotations

import argparse

import msgspec
import pytest

import sgl
from sgl.cli import build_parser, serve_args
from sgl.cli_args import server_args_from
from sgl.core.server_args import ServerArgs
from sgl.core.server_args_help import FIELD_HELP


def _serve_ns(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_every_field_is_a_flag() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for f in msgspec.structs.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in help_text, f.name


def test_flags_map_to_server_args() -> None:
    args = server_args_from(_serve_ns("--port", "8080", "--mem-fraction-static", "0.5", "--disable-radix-cache",
                                      "--schedule-policy", "lpm", "--max-running-requests", "8", "--api-key", "k"))
    assert (args.port, args.mem_fraction_static, args.disable_radix_cache) == (8080, 0.5, True)
    assert (args.schedule_policy, args.max_running_requests, args.api_key) == ("lpm", 8, "k")
    assert server_args_from(_serve_ns()) == ServerArgs()


def test_bad_flag_values() -> None:
    with pytest.raises(SystemExit):
        _serve_ns("--schedule-policy", "random")
    with pytest.raises(SystemExit):
        _serve_ns("--port", "eighty")
    with pytest.raises(ValueError, match="port"):
        server_args_from(_serve_ns("--port", "99999"))
    with pytest.raises(ValueError, match="mem_fraction_static"):
        server_args_from(_serve_ns("--mem-fraction-static", "1.5"))


def test_every_flag_has_help() -> None:
    fields = {f.name for f in msgspec.structs.fields(ServerArgs)}
    assert fields <= set(FIELD_HELP), fields - set(FIELD_HELP)
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    for parser in (serve, generate):
        for action in parser._actions:
            assert action.help and action.help.strip(), action.dest
    assert "the HTTP server's port; 0 picks a free one (default: 30000)" in " ".join(serve.format_help().split())


def test_positional_model_and_lists() -> None:
    assert serve_args(_serve_ns("some/model")).model_path == "some/model"
    assert serve_args(_serve_ns("m", "--model-path", "m")).model_path == "m"
    with pytest.raises(ValueError, match="two models"):
        serve_args(_serve_ns("a", "--model-path", "b"))
    args = serve_args(_serve_ns("m", "--allow-origins", "http://a.test", "http://b.test",
                                "--chat-template", "{{ messages }}", "--incremental-streaming-output"))
    assert args.allow_origins == ["http://a.test", "http://b.test"] and args.incremental_streaming_output
    assert args.chat_template == "{{ messages }}" and serve_args(_serve_ns()).random_seed is None


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"sgl {sgl.__version__}"
