"""`sgl serve` flags come from the ServerArgs fields: every field has its flag,
values are typed, choices come from Literal fields, bad values name the field."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from sgl.cli import build_parser
from sgl.cli_args import server_args_from
from sgl.core.server_args import ServerArgs


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
