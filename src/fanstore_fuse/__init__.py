"""fanstore-fuse: a job-scoped, FUSE-mounted distributed transient file system for DL I/O."""

from typing import TYPE_CHECKING, Any

from ._errors import ChecksumError, FanstoreError, FormatError
from ._format import FORMAT_VERSION, Manifest
from ._manifest import read_manifest
from ._namespace import Namespace

if TYPE_CHECKING:
    from ._prep import PrepOptions, PrepResult, prep
    from ._verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "ChecksumError",
    "FanstoreError",
    "FormatError",
    "Manifest",
    "Namespace",
    "PrepOptions",
    "PrepResult",
    "VerifyReport",
    "__version__",
    "prep",
    "read_manifest",
    "verify",
]


_LAZY = {"PrepOptions": "_prep", "PrepResult": "_prep", "prep": "_prep",
         "VerifyReport": "_verify", "verify": "_verify"}


def __getattr__(name: str) -> Any:
    """prep and verify are imported on first use: a mount daemon needs neither (zstandard's
    trainer, the thread pools and the walk stay out of its start-up)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
