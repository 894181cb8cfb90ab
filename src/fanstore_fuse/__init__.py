"""fanstore-fuse: a job-scoped, FUSE-mounted distributed transient file system for DL I/O."""

from . import _fastclose  # noqa: F401  (first: loads the FOPEN_NOFLUSH shim before pyfuse3)
from ._errors import ChecksumError, FanstoreError, FormatError
from ._format import FORMAT_VERSION, Manifest, read_manifest
from ._namespace import Namespace
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
