"""fanstore_fuse.tensorio: save and load tensors with the fastest tool, chosen by measurement.

One file format for every tool (see ``_format``), a selector that learns which tool is fastest
per (operation, device, size bucket, cold/warm, file system), and a feature-map offload context.
Needs the ``tensor`` extra (torch, safetensors, numpy).
"""

from ._api import eligible, info, load, register, save, tools, unregister
from ._errors import TensorChecksumError, TensorFormatError, TensorIOError
from ._format import VERSION, read_layout
from ._fs import cache_state, drop_cache, fs_type, residency
from ._offload import offload
from ._selector import (
    ENV_DB,
    ENV_TOOL,
    Selector,
    default_selector,
    machine_stamp,
    make_key,
    set_default_selector,
    size_bucket,
)
from ._tools import Tool

__all__ = [
    "ENV_DB",
    "ENV_TOOL",
    "VERSION",
    "Selector",
    "TensorChecksumError",
    "TensorFormatError",
    "TensorIOError",
    "Tool",
    "cache_state",
    "default_selector",
    "drop_cache",
    "eligible",
    "fs_type",
    "info",
    "load",
    "machine_stamp",
    "make_key",
    "offload",
    "read_layout",
    "register",
    "residency",
    "save",
    "set_default_selector",
    "size_bucket",
    "tools",
    "unregister",
]
