"""Files and directories a job writes into the mount, kept on the writer's node.

`WriteStore` (`_store`) is the API; `_journal` is the on-disk journal and layout, `_tree` the
in-memory entry tree, `_hashing` the xxh3 digests (shared with stage-out). Pure library code:
no FUSE, no MPI, no trio.
"""

from ._base import WriteStats
from ._hashing import CHUNK, Hasher, hash_file
from ._journal import DATA_DIR, JOURNAL_NAME, WRITES_DIR, Journal, has_records
from ._store import WriteStore
from ._tree import WRITE_INODE_BASE, CommitInfo, split_path

__all__ = [
    "CHUNK", "DATA_DIR", "JOURNAL_NAME", "WRITES_DIR", "WRITE_INODE_BASE", "CommitInfo", "Hasher",
    "Journal", "WriteStats", "WriteStore", "has_records", "hash_file", "split_path",
]
