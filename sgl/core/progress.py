"""Progress bars without global side effects: tqdm's own class starts a monitor
thread ("tqdm_monitor") that outlives the bar, and switching that off through
`tqdm.monitor_interval = 0` changes every tqdm in the process. A subclass with its
own monitor_interval of 0 starts none; bars draw only when stderr is a terminal."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class _Bar(tqdm):
    monitor_interval = 0  # this class only: no monitor thread


def progress_bar(iterable: Any = None, **kwargs: Any) -> Any:
    """A tqdm bar over `iterable` (or a manual one) that starts no thread and draws
    nothing unless stderr is a terminal."""
    kwargs.setdefault("disable", not sys.stderr.isatty())
    return _Bar(iterable, **kwargs)
