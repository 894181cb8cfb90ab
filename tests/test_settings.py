"""The environment settings: every `FANSTORE_*` name in src/ is a field of `Settings` and a row
of the README's tuning table, and there are at most 20 of them (two kept free for the launcher's
MPI names)."""

from __future__ import annotations

import re
from pathlib import Path

from fanstore_fuse._settings import ENV, Settings

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = {"FANSTORE_MPIEXEC", "FANSTORE_SRUN_MPI"}  # the launcher's site MPI names


def _names_in_src() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "src").rglob("*.py"):
        names |= set(re.findall(r"FANSTORE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    return names


def test_every_environment_name_is_a_setting_and_a_readme_row():
    names = _names_in_src()
    assert len(names | LAUNCHER) <= 20, sorted(names)
    fields = set(Settings.__dataclass_fields__)
    assert set(ENV) == fields
    assert names - set(ENV.values()) <= {"FANSTORE_MPIEXEC"}, sorted(names - set(ENV.values()))
    readme = (ROOT / "README.md").read_text()
    rows = set(re.findall(r"^\| `(FANSTORE_[A-Z0-9_]+)`", readme, re.M))
    assert set(ENV.values()) <= rows, sorted(set(ENV.values()) - rows)
