"""Progress bars: one rule for every bar of the package (fitting, the compare job)."""

from __future__ import annotations

from typing import Any


def progress_bar(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm bar for fitting and the compare job, or None: not ``enabled``, tqdm missing, or stderr not a terminal.

    Every bar of the package is made here so that all follow one rule: a bar redrawn in a redirected log writes
    one line per update and buries the output, so ``disable=None`` (tqdm's "off when the file is not a TTY").
    In a notebook tqdm.auto's widget ignores that test and shows the bar.
    """
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a convenience: fitting works without tqdm
        return None
    bar = tqdm(total=total, desc=desc, leave=False, disable=None)
    if bar.disable:
        bar.close()
        return None
    return bar
