"""The adaptive tool selector (Fastensor's dictionary, keyed better).

Keys are ``op|device|b<log2 size bucket>|cold/warm/-|fs type``. For a new key the selector
explores: each call goes to the eligible tool with the fewest samples, a tool whose best
seconds-per-byte is more than ``drop_factor`` times the best one is dropped, and once every
remaining tool has ``explore_rounds`` samples it commits to the fastest (lowest minimum: noise
from other processes only adds time). A
committed tool that is ``slow_factor`` (2) times slower than its committed median for
``patience`` (5) calls in a row sends the key back to exploration (so do
``reexplore_every`` committed calls, if
set). The dictionary persists as JSON stamped with host, CPU model and library versions; a file
with another stamp is ignored. ``FANSTORE_TENSORIO_TOOL`` (or ``tool=``) forces a tool.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

ENV_TOOL = "FANSTORE_TENSORIO_TOOL"
ENV_DB = "FANSTORE_TENSORIO_DB"


def size_bucket(nbytes: int) -> int:
    """ceil(log2(nbytes)): sizes within a factor of two share a bucket."""
    return max(0, int(nbytes - 1).bit_length())


def make_key(op: str, device: str, nbytes: int, cache: str, fstype: str) -> str:
    return f"{op}|{device}|b{size_bucket(nbytes)}|{cache}|{fstype}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_stamp() -> dict[str, Any]:
    """What the measurements depend on: host, CPU, GPU and library versions."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for mod in ("torch", "safetensors", "numpy", "kvikio"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    from ._format import VERSION

    versions["tensorio_format"] = str(VERSION)
    gpu = None
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    return {"host": socket.gethostname(), "cpu": _cpu_model(), "gpu": gpu, "versions": versions}


def default_db_path() -> str | None:
    env = os.environ.get(ENV_DB)
    if env is not None:
        return None if env in ("", "off", "0") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fanstore-fuse", "tensorio-selector.json")


class Selector:
    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        explore_rounds: int = 3,
        drop_factor: float = 2.0,
        slow_factor: float = 2.0,
        patience: int = 5,
        reexplore_every: int = 0,
        stamp: dict[str, Any] | None = None,
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.clock = clock
        self.explore_rounds = explore_rounds
        self.drop_factor = drop_factor
        self.slow_factor = slow_factor
        self.patience = patience
        self.reexplore_every = reexplore_every
        self.stamp = stamp if stamp is not None else machine_stamp()
        self.entries: dict[str, dict[str, Any]] = {}
        self.last_choice: str | None = None
        self._lock = threading.RLock()
        if self.path:
            self.load()

    # ------------------------------------------------------------------ decisions

    def _entry(self, key: str) -> dict[str, Any]:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _fresh()
        return e

    def choose(self, key: str, eligible: Sequence[str], override: str | None = None) -> str:
        """The tool to use for this call (override > env var > committed > next to explore)."""
        if not eligible:
            raise ValueError("no eligible tool")
        forced = override or os.environ.get(ENV_TOOL) or None
        if forced:
            if forced not in eligible:
                raise ValueError(f"tool {forced!r} is not eligible here (eligible: {list(eligible)})")
            self.last_choice = forced
            return forced
        with self._lock:
            e = self._entry(key)
            if e["state"] == "commit" and e["choice"] in eligible:
                self.last_choice = e["choice"]
                return e["choice"]
            if e["state"] == "commit":  # committed tool no longer eligible
                self._reexplore(key, e, "committed tool no longer eligible")
            cands = [t for t in eligible if t not in e["dropped"]] or list(eligible)
            e["eligible"] = list(eligible)
            pick = min(cands, key=lambda t: (len(e["samples"].get(t, [])), cands.index(t)))
            self.last_choice = pick
            return pick

    def record(self, key: str, tool: str, seconds: float, nbytes: int) -> None:
        """One measured call. Times are compared per byte, so sizes within a bucket mix."""
        spb = max(seconds, 1e-12) / max(nbytes, 1)
        with self._lock:
            e = self._entry(key)
            if e["state"] == "commit":
                if tool != e["choice"]:
                    return  # a forced call: not part of the decision
                e["calls"] += 1
                e["slow"] = e["slow"] + 1 if spb > self.slow_factor * e["best"] else 0
                if e["slow"] >= self.patience:
                    self._reexplore(key, e, f"{tool} slowed down")
                elif self.reexplore_every and e["calls"] % self.reexplore_every == 0:
                    self._reexplore(key, e, "periodic check")
                return
            e["samples"].setdefault(tool, []).append(spb)
            eligible = e.get("eligible") or list(e["samples"])
            if tool not in eligible:
                eligible.append(tool)
            best = {t: min(s) for t, s in e["samples"].items() if s and t in eligible}
            top = min(best.values())
            for t, b in best.items():
                if b > self.drop_factor * top and t not in e["dropped"]:
                    e["dropped"].append(t)
            alive = [t for t in eligible if t not in e["dropped"]]
            if alive and all(len(e["samples"].get(t, [])) >= self.explore_rounds for t in alive):
                # lowest best-case time: noise from other processes only ever adds time
                choice = min(alive, key=lambda t: (min(e["samples"][t]),
                                                   statistics.median(e["samples"][t])))
                e.update(state="commit", choice=choice, calls=0, slow=0,
                         best=statistics.median(e["samples"][choice]))
                log.info("tensorio: %s -> %s", key, choice)
                self._persist()

    def fail(self, key: str, tool: str) -> None:
        """A tool raised on this key: never pick it again here until re-exploration."""
        with self._lock:
            e = self._entry(key)
            if tool not in e["dropped"]:
                e["dropped"].append(tool)
            if e["state"] == "commit" and e["choice"] == tool:
                self._reexplore(key, e, f"{tool} failed", keep_dropped=True)

    def decision(self, key: str) -> str | None:
        e = self.entries.get(key)
        return e["choice"] if e and e["state"] == "commit" else None

    def _reexplore(self, key: str, e: dict[str, Any], why: str, keep_dropped: bool = False) -> None:
        log.info("tensorio: re-exploring %s (%s)", key, why)
        dropped = e["dropped"] if keep_dropped else []
        e.clear()
        e.update(_fresh())
        e["dropped"] = dropped
        self._persist()

    # ------------------------------------------------------------------ persistence

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {"stamp": self.stamp, "entries": json.loads(json.dumps(self.entries))}

    def load(self) -> bool:
        """Load the persisted dictionary; ignored (False) when missing, corrupt or stamped for
        another machine or other library versions."""
        if not self.path:
            return False
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            log.warning("tensorio: ignoring unreadable selector file %s: %s", self.path, exc)
            return False
        if not isinstance(data, dict) or data.get("stamp") != self.stamp:
            log.info("tensorio: selector file %s is for another machine/versions; ignored", self.path)
            return False
        entries = data.get("entries")
        if not isinstance(entries, dict):
            return False
        with self._lock:
            self.entries = {k: {**_fresh(), **v} for k, v in entries.items() if isinstance(v, dict)}
        return True

    def save(self) -> None:
        if not self.path:
            return
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def _persist(self) -> None:
        try:
            self.save()
        except OSError as exc:
            log.warning("tensorio: cannot persist selector to %s: %s", self.path, exc)


def _fresh() -> dict[str, Any]:
    return {"state": "explore", "samples": {}, "dropped": [], "eligible": [], "choice": None,
            "best": None, "calls": 0, "slow": 0}


_DEFAULT: Selector | None = None
_DEFAULT_LOCK = threading.Lock()


def default_selector() -> Selector:
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Selector(default_db_path())
        return _DEFAULT


def set_default_selector(sel: Selector | None) -> None:
    """Replace the process-wide selector (None: rebuild from the environment on next use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        _DEFAULT = sel
