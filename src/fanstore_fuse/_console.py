"""The CLI's terminal output: rich's Console on stderr and progress bars, imported on first use
(a daemon never prints, so rich stays out of its start-up), and the widened-DEST warning."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


class _Stderr:
    """rich's Console on stderr, imported on first use (a daemon never prints: rich stays out
    of its start-up)."""

    _console: Any = None

    def console(self) -> Console:
        if _Stderr._console is None:
            from rich.console import Console

            _Stderr._console = Console(stderr=True, soft_wrap=True)
        return _Stderr._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console(), name)


err = _Stderr()


def progress(quiet: bool) -> Progress:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err.console(),
        disable=quiet or not err.is_terminal,
        transient=True,
    )


def warn_widened(dest: str) -> None:
    from ._perms import dest_warning

    msg = dest_warning(dest)
    if msg:
        err.print(f"[yellow]fanstore-fuse: warning:[/] {msg}", highlight=False)


def warn_widened_meanwhile(dest: str) -> Callable[[], None]:
    """`warn_widened` in a thread from now on; the call returned waits for it and prints."""
    import threading

    thread = threading.Thread(target=warn_widened, args=(dest,), daemon=True)
    thread.start()
    return thread.join
