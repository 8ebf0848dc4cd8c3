"""Command-line flags generated from the ServerArgs fields: one `--field-name` per
field (SGLang's spelling), typed and with choices from the field's annotation (a
list field takes several values), its help from server_args_help.

It only maps argv to ServerArgs; it must not hold a hand-written list of flags,
so a new ServerArgs field is a new flag with no edit here."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from sgl.core.server_args import ServerArgs
from sgl.core.server_args_help import FIELD_HELP

# A flag's value type for msgspec's type descriptions; anything else is a str.
_SCALARS: dict[type, Any] = {
    msgspec.inspect.IntType: int,
    msgspec.inspect.FloatType: float,
    msgspec.inspect.StrType: str,
}


def _unwrap_optional(t: msgspec.inspect.Type) -> msgspec.inspect.Type:
    if isinstance(t, msgspec.inspect.UnionType):
        rest = [x for x in t.types if not isinstance(x, msgspec.inspect.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return t


def add_server_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per ServerArgs field. Unset flags leave no attribute on the namespace."""
    info = msgspec.inspect.type_info(ServerArgs)
    assert isinstance(info, msgspec.inspect.StructType)
    group = parser.add_argument_group("server arguments (sgl.ServerArgs)")
    for f in info.fields:
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        t = _unwrap_optional(f.type)
        default = f.default if f.default is not msgspec.NODEFAULT else None
        if f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        text = FIELD_HELP.get(f.name, "")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                              "help": f"{text} (default: {default})" if text else f"(default: {default})"}
        if isinstance(t, msgspec.inspect.BoolType):
            kw["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        elif isinstance(t, msgspec.inspect.LiteralType):
            kw["choices"] = list(t.values)
            kw["type"] = type(t.values[0])
        elif isinstance(t, msgspec.inspect.ListType):  # --flag A B ...
            kw["nargs"] = "*"
            kw["type"] = _SCALARS.get(type(t.item_type), str)
            kw["metavar"] = f.name.upper()
        else:
            kw["type"] = _SCALARS.get(type(t), str)
            kw["metavar"] = f.name.upper()
        group.add_argument(flag, **kw)


def server_args_from(ns: argparse.Namespace, **overrides: Any) -> ServerArgs:
    """The ServerArgs for the flags given; a bad value is a ValueError naming the field."""
    fields = {f.name for f in msgspec.structs.fields(ServerArgs)}
    given = {k: v for k, v in vars(ns).items() if k in fields}
    return ServerArgs.from_kwargs(**{**given, **overrides})
