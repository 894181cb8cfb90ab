"""Errors raised by tensorio; they extend the project's domain errors."""

from __future__ import annotations

from fanstore_fuse._errors import ChecksumError, FanstoreError, FormatError


class TensorIOError(FanstoreError):
    """A transfer tool failed or no tool is eligible for a call."""


class TensorFormatError(FormatError):
    """The file is not a tensorio file, is truncated, or is from an unsupported version."""


class TensorChecksumError(ChecksumError):
    """Header or tensor bytes do not match their recorded xxh3-64: nothing is returned."""


__all__ = ["TensorChecksumError", "TensorFormatError", "TensorIOError"]
