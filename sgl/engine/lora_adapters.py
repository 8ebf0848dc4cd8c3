"""`LoraAdapters`: the LoRA adapters an engine serves, as its front end knows them, and
the fast checks of the adapter a request names (docs/lora.md).

The scheduler is the authority: it refuses an unknown adapter itself, so these checks
only answer sooner (before anything is sent) and in the caller's field. Whatever this
object does not know it lets through. It sends nothing: the front end feeds it the
replies of its load and unload calls and the scheduler's server info."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sgl.core import lora_rules
from sgl.core.server_args import ServerArgs
from sgl.engine.control_args import FieldError

INFO_KEY = "lora_adapters"  # the scheduler's server info: {name: path} of the adapters loaded


class UnknownLoraAdapter(FieldError):
    """A request (field lora_path) or an unload (lora_name) naming an adapter that is not
    loaded: a ValueError, over HTTP a 400 (vLLM's unload route: a 404)."""


class LoraAdapters:
    """Whether the engine serves adapters (`enabled`; None: not known, for a client attached
    to another process's engine) and {name: path} of those loaded (`loaded`; None: not
    known, and then only the scheduler checks names). Changed only by `learn` (server
    info) and `after` (a load's or an unload's reply)."""

    def __init__(self, enabled: bool | None, loaded: dict[str, str] | None) -> None:
        self.enabled = enabled
        self.loaded = loaded

    @classmethod
    def of_args(cls, args: ServerArgs) -> LoraAdapters:
        """An engine's own: as it was started (lora_paths)."""
        return cls(args.lora_enabled, args.lora_adapters if args.lora_enabled else {})

    @classmethod
    def of_info(cls, info: dict[str, Any]) -> LoraAdapters:
        """An attached client's: the scheduler's server info says which are loaded, if it says."""
        return cls(None, _reported(info))

    def listed(self) -> dict[str, str]:
        """{name: path} of the adapters known to be loaded, in the order they were loaded."""
        return dict(self.loaded or {})

    def learn(self, info: dict[str, Any]) -> None:
        """The scheduler's server info: the adapters it holds now (any client's loads
        included); a scheduler that does not report them leaves names unchecked here."""
        self.loaded = _reported(info)
        if self.loaded and self.enabled is None:
            self.enabled = True

    def after(self, reply: dict[str, Any], name: str, path: str | None) -> None:
        """A successful load (`path`) or unload (None) of `name`: the reply's
        loaded_adapters, or the change itself where the reply lists none."""
        listed = _reported(reply, "loaded_adapters")
        if listed is not None:
            self.loaded = listed
        elif self.loaded is not None:
            if path is None:
                self.loaded.pop(name, None)
            else:
                self.loaded[name] = path

    def check_enabled(self, field: str) -> None:
        """A ValueError naming `field` when the engine is known to serve no adapters."""
        if self.enabled is False:
            raise FieldError(field, lora_rules.disabled(field))

    def requested(self, values: Iterable[Any]) -> set[str]:
        """The adapter names of a call's requests (a value per request; None: the base
        model), each checked as a name; a ValueError naming lora_path for a bad one, or
        for any on an engine that serves none."""
        names: set[str] = set()
        for value in values:
            if value is None:
                continue
            if not lora_rules.is_name(value):
                raise FieldError("lora_path", lora_rules.bad_name("lora_path", value))
            names.add(value)
        if names:
            self.check_enabled("lora_path")
        return names

    def lacks(self, names: Iterable[str]) -> bool:
        """Whether a name is missing from the adapters known to be loaded (never, when they are not known)."""
        return self.loaded is not None and any(n not in self.loaded for n in names)

    def check(self, names: Iterable[str], field: str) -> None:
        """An UnknownLoraAdapter for the first name (sorted) known not to be loaded."""
        if self.loaded is None:
            return
        missing = sorted(n for n in names if n not in self.loaded)
        if missing:
            raise UnknownLoraAdapter(field, lora_rules.not_loaded(field, missing[0], self.loaded))


def _reported(data: dict[str, Any], key: str = INFO_KEY) -> dict[str, str] | None:
    """{name: path} under `key`, or None where `data` has none."""
    value = data.get(key)
    if not isinstance(value, dict):
        return None
    return {str(name): str(path) for name, path in value.items()}
