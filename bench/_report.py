"""Tables (absolute figures, ratios against every anchor, targets with PASS/MISS), the costs file
for the scale model, the PNG plot and the docs/performance.md block."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

ANCHORS = ("native", "squashfuse", "ratarmount")
MPI_CHUNK_KIB = "4096"  # the chunk size remote reads move
DOCS_BEGIN = "<!-- bench:begin (written by `python -m bench.run --update-docs`) -->"
DOCS_END = "<!-- bench:end -->"


def _get(d: dict | None, *path: str):
    """d[path...], or None when missing or when the measurement holding it reports an error."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        if not isinstance(d[p], dict) and "error" in d:
            return None
        d = d[p]
    if isinstance(d, dict) and "error" in d:
        return None
    return d


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _read(s: dict, wl: str, temp: str, r: int, unit: str) -> float | None:
    return _num(_get(s, "reads", wl, temp, str(r), unit))


# ---------------------------------------------------------------------------------------------
# metrics: (key, label, unit, getter(system result) -> value, higher_is_better)

Metric = tuple[str, str, str, Callable[[dict], float | None], bool]


def metrics(readers: list[int]) -> list[Metric]:
    out: list[Metric] = []
    for wl, wlabel, unit, ulabel in (
        ("small", "small 110 KiB", "files_per_s", "files/s"),
        ("npy", "npy (compressible)", "files_per_s", "files/s"),
        ("large", "large", "MB_per_s", "MB/s"),
    ):
        for temp in ("cold", "warm"):
            for r in readers:
                out.append((
                    f"{wl}.{temp}.{r}", f"{wlabel} {temp}, {r} reader{'s' if r > 1 else ''}",
                    ulabel, lambda s, wl=wl, t=temp, r=r, u=unit: _read(s, wl, t, r, u), True,
                ))  # fmt: skip
    out += [
        ("stat", "stat every file, fresh mount", "files/s",
         lambda s: _num(_get(s, "stat", "files_per_s")), True),
        ("walkstat", "walk + stat every file (ImageFolder), cold", "files/s",
         lambda s: _num(_get(s, "walkstat", "files_per_s")), True),
        ("ls.cold", "ls -lR, cold", "s", lambda s: _num(_get(s, "ls_cold", "seconds")), False),
        ("ls.warm", "ls -lR, warm", "s", lambda s: _num(_get(s, "ls_warm", "seconds")), False),
        ("prep", "prep (image build)", "s", lambda s: _num(_get(s, "prep", "prep_s")), False),
        ("image", "image size", "MB",
         lambda s: (_num(_get(s, "prep", "image_bytes")) or math.nan) / 1e6
         if _get(s, "prep", "image_bytes") else None, False),
        ("mount", "mount (incl. stage-in copy)", "s",
         lambda s: _num(_get(s, "mount", "mount_s")), False),
        ("remote", "remote large reads, cold, 1 reader", "MB/s",
         lambda s: _num(_get(s, "remote", "cold", "1", "MB_per_s")), True),
        ("remote.warm", "remote large reads, warm, 1 reader", "MB/s",
         lambda s: _num(_get(s, "remote", "warm", "1", "MB_per_s")), True),
        ("remote.mixed", "large via rank 0 (mixed local/remote), cold, 1 reader", "MB/s",
         lambda s: _num(_get(s, "remote", "cold", "1", "mixed_MB_per_s")), True),
        ("remote.frac", "  remote byte fraction of that read", "",
         lambda s: _num(_get(s, "remote", "cold", "1", "remote_byte_fraction")), True),
        ("sym.cold", "small cold, 1 reader per rank on its own mount, per node", "files/s",
         lambda s: _num(_get(s, "remote", "symmetric_small", "cold", "files_per_s_per_node")),
         True),
        ("sym.warm", "small warm, 1 reader per rank on its own mount, per node", "files/s",
         lambda s: _num(_get(s, "remote", "symmetric_small", "warm", "files_per_s_per_node")),
         True),
        ("sym.frac", "  remote byte fraction (symmetric, cold)", "",
         lambda s: _num(_get(s, "remote", "symmetric_small", "cold", "remote_byte_fraction")),
         True),
    ]  # fmt: skip
    return out


def _fs_keys(results: dict) -> list[str]:
    return [k for k in results.get("systems", {}) if k.startswith("fanstore")]


def _fsn_key(results: dict) -> str | None:
    ks = [k for k in _fs_keys(results) if k != "fanstore1"]
    return ks[0] if ks else None


def mpi_MBps(results: dict) -> float | None:
    return _num(_get(results, "mpi", "stream", MPI_CHUNK_KIB, "MB_per_s"))


# ---------------------------------------------------------------------------------------------
# targets


def checks(results: dict) -> list[dict]:
    S = results.get("systems", {})
    readers = results["meta"]["readers"]
    fs1 = S.get("fanstore1", {})
    fsn = S.get(_fsn_key(results) or "", {})
    out: list[dict] = []

    def add(name, value, anchor, anchor_value, target, ratio=None, note=""):
        if ratio is None and value is not None and anchor_value:
            ratio = value / anchor_value
        status = "n/a" if ratio is None else ("PASS" if ratio >= target - 1e-12 else "MISS")
        out.append({
            "name": name, "value": value, "anchor": anchor, "anchor_value": anchor_value,
            "ratio": ratio, "target": target, "status": status, "note": note,
        })  # fmt: skip

    for temp in ("cold", "warm"):
        for r in readers:
            v = _read(fs1, "small", temp, r, "files_per_s")
            add(f"small {temp} {r}r vs squashfuse", v, "squashfuse",
                _read(S.get("squashfuse", {}), "small", temp, r, "files_per_s"), 1.0)  # fmt: skip
            add(f"small {temp} {r}r vs ratarmount", v, "ratarmount",
                _read(S.get("ratarmount", {}), "small", temp, r, "files_per_s"), 3.0)  # fmt: skip
    for temp in ("cold", "warm"):
        for r in readers:
            add(f"large {temp} {r}r vs squashfuse", _read(fs1, "large", temp, r, "MB_per_s"),
                "squashfuse", _read(S.get("squashfuse", {}), "large", temp, r, "MB_per_s"), 1.0)  # fmt: skip
    note = str(_get(fsn, "remote", "note") or "")
    add("remote large (cold, 1r) vs raw MPI 4 MiB", _num(_get(fsn, "remote", "cold", "1",
        "MB_per_s")), "mpi Send/Recv", mpi_MBps(results), 0.7, note=note)  # fmt: skip
    add("stat every file vs ratarmount", _num(_get(fs1, "stat", "files_per_s")), "ratarmount",
        _num(_get(S.get("ratarmount", {}), "stat", "files_per_s")), 2.0)  # fmt: skip
    add("walk + stat every file vs ratarmount", _num(_get(fs1, "walkstat", "files_per_s")),
        "ratarmount", _num(_get(S.get("ratarmount", {}), "walkstat", "files_per_s")), 2.0)  # fmt: skip
    p_fs = _num(_get(fs1, "prep", "prep_s"))
    p_sq = _num(_get(S.get("squashfuse", {}), "prep", "prep_s"))
    add("prep vs mksquashfs (speed = time ratio)", p_fs, "mksquashfs", p_sq, 1.0,
        ratio=(p_sq / p_fs) if p_fs and p_sq else None)  # fmt: skip
    m_fs = _num(_get(fs1, "mount", "mount_s"))
    cp = _num(_get(results, "cp_stage_in", "seconds"))
    add("stage-in vs cp -r DEST (speed = time ratio)", m_fs, "cp -r", cp, 0.8,
        ratio=(cp / m_fs) if m_fs and cp else None)  # fmt: skip
    # the ring: from the scale model's machine-readable summary when it gives one
    sm = _get(results, "scale_model", "json") or {}
    for n in ("512", "4096"):
        ring = _find_ring(sm, n)
        lb, moved, frac = ring
        add(f"ring {n} nodes: max/mean load <= 1.10", lb, "", None, 1.0,
            ratio=(1.10 / lb) if lb else None, note="ratio = 1.10 / measured")  # fmt: skip
        bound = 1 / int(n) + 0.05
        add(f"ring {n} nodes: keys moved <= 1/N + 5%", moved, "", None, 1.0,
            ratio=(bound / moved) if moved else (None if moved is None else math.inf),
            note=f"ratio = (1/N+5%) / measured{frac}")  # fmt: skip
    return out


def _find_ring(sm: dict, n: str) -> tuple[float | None, float | None, str]:
    """Pull (max/mean load, fraction moved) for n nodes out of the scale model's JSON.

    Accepts {"ring": {"512": {"max_mean": x, "moved": y}}} and close variants."""
    ring = sm.get("ring", sm) if isinstance(sm, dict) else {}
    node = ring.get(n) or ring.get(int(n)) if isinstance(ring, dict) else None
    if not isinstance(node, dict):
        return None, None, ""
    lb = None
    moved = None
    for k, v in node.items():
        kl = k.lower()
        if lb is None and ("max_mean" in kl or "max/mean" in kl or "imbalance" in kl):
            lb = _maxval(v)
        if moved is None and "moved" in kl:
            moved = _maxval(v)
    return lb, moved, ""


def _maxval(v) -> float | None:
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, dict):
        vals = [_maxval(x) for x in v.values()]
        vals = [x for x in vals if x is not None]
        return max(vals) if vals else None
    return None


# ---------------------------------------------------------------------------------------------
# costs for the scale model


def costs(results: dict) -> dict:
    """Per-operation costs measured in this run (fanstore-fuse when it ran, else an anchor)."""
    S = results.get("systems", {})
    fsn = _fsn_key(results)

    def pick(getter, order):
        for k in order:
            v = getter(S.get(k, {}))
            if v:
                return v, k
        return None, None

    local, src_l = pick(lambda s: _read(s, "small", "cold", 1, "files_per_s"),
                        ["fanstore1", "squashfuse", "native"])  # fmt: skip
    local_w, src_lw = pick(lambda s: _read(s, "small", "warm", 1, "files_per_s"),
                           ["fanstore1", "squashfuse", "native"])  # fmt: skip
    remote, src_r = pick(lambda s: _num(_get(s, "remote", "cold", "1", "MB_per_s")), [fsn or ""])
    stat, src_s = pick(lambda s: _num(_get(s, "stat", "files_per_s")),
                       ["fanstore1", "squashfuse", "native"])  # fmt: skip
    mpi = mpi_MBps(results)
    remote_files_s, src_rf = None, "not measured: the scale model derives it"
    sym = _get(S.get(fsn or "", {}), "remote", "symmetric_small", "cold") or {}
    r_sym, f = _num(sym.get("files_per_s_per_node")), _num(sym.get("remote_byte_fraction"))
    if r_sym and f and local:
        denom = 1 / r_sym - (1 - f) / local
        if denom > 0:
            remote_files_s = f / denom
            src_rf = (f"{fsn} symmetric small cold reads: {r_sym:,.0f} files/s per node with remote "
                      f"fraction {f:.2f}; remote = f / (1/rate - (1-f)/local_small_files_per_s)")  # fmt: skip
    if remote is None:
        src_r = "not measured (no multi-rank fanstore-fuse run): the scale model's default"
    small_mean = results["meta"]["dataset"]["params"].get("small_mean", 112640)
    return {
        "local_small_files_per_s": local,
        "local_small_files_per_s_warm": local_w,
        "remote_files_s": remote_files_s,
        "remote_fetch_MB_per_s": remote,
        "mpi_MB_per_s": mpi,
        "stat_per_s": stat,
        "file_bytes": small_mean,
        "chunk_bytes": int(MPI_CHUNK_KIB) * 1024,
        "cpus": results["meta"].get("cpus"),
        "source": {
            "local_small_files_per_s": f"{src_l} small cold 1 reader",
            "local_small_files_per_s_warm": f"{src_lw} small warm 1 reader",
            "remote_fetch_MB_per_s": str(src_r),
            "remote_files_s": src_rf,
            "mpi_MB_per_s": f"mpi4py Send/Recv {MPI_CHUNK_KIB} KiB stream",
            "stat_per_s": f"{src_s} stat on fresh mount",
        },
    }


# ---------------------------------------------------------------------------------------------
# text


def _f(v: float | None, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if unit == "s":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    if unit == "x":
        return "inf" if math.isinf(v) else f"{v:.2f}×"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(results: dict) -> str:
    S = results.get("systems", {})
    meta = results["meta"]
    ds = meta["dataset"]
    keys = list(S)
    out: list[str] = []
    out.append(f"### Benchmark: `{meta['mode']}` mode, {meta['date']}")
    out.append("")
    out.append(f"`python -m bench.run {' '.join(meta.get('argv') or [])}`".replace(" `", "`"))
    out.append("")
    out.append(
        f"{meta['cpus']} CPUs, kernel {meta['kernel']}, Python {meta['python']}; "
        f"dataset: {ds['files']['small']:,} small files ({ds['bytes']['small'] / 1e6:,.0f} MB), "
        f"{ds['files']['npy']:,} npy/csv files ({ds['bytes']['npy'] / 1e6:,.0f} MB), "
        f"{ds['files']['large']} large files ({ds['bytes']['large'] / 1e6:,.0f} MB)"
        + ("" if meta["mode"] == "full" else f" — reduced {meta['mode']} mode") + "; "
        f"zstd level {meta['level']}; cold = after `echo 3 > /proc/sys/vm/drop_caches`"
        + ("" if meta["drop_caches"] else " (**NOT dropped**: " + meta["drop_caches_error"] + ")")
        + " (FUSE daemons' own caches are not dropped); MB = 10^6 bytes."
    )
    out.append("")
    for k in keys:
        sub = S[k].get("subset")
        if sub:
            out.append(f"{S[k]['label']} read an evenly spread subset (" + ", ".join(
                f"{n:,} of {ds['files'][w]:,} {w}" for w, n in sub.items())
                + f"), {meta.get('multi_rank_repeat', 1)}× per case, to fit the time budget.")  # fmt: skip
            out.append("")
    na = [f"- **{S[k]['label']}**: {S[k]['error']}" for k in keys if "error" in S[k]]
    if na:
        out += ["Not measured / failed:", *na, ""]
    # absolute table
    head = ["metric", "unit", *[S[k]["label"] for k in keys]]
    rows = []
    for _key, label, unit, get, _hib in metrics(meta["readers"]):
        vals = [get(S[k]) for k in keys]
        if all(v is None for v in vals):
            continue
        rows.append([label, unit, *[_f(v, unit) for v in vals]])
    mpi = results.get("mpi", {})
    extra = []
    if "error" not in mpi:
        for mode, lab in (("stream", "raw MPI Send/Recv stream"), ("hot", "raw MPI, same buffer"),
                          ("pickled", "MPI pickled bytes (send/recv)"),
                          ("pingpong", "MPI request/response")):  # fmt: skip
            v = _num(_get(mpi, mode, MPI_CHUNK_KIB, "MB_per_s"))
            if v is not None:
                extra.append(f"{lab}, 4 MiB messages: **{_f(v)} MB/s**")
    else:
        extra.append(f"raw MPI: {mpi['error']}")
    cps = results.get("cp_stage_in", {})
    if "seconds" in cps:
        extra.append(f"`cp -r` of the prepped DEST (cold): {_f(cps['seconds'], 's')} s "
                     f"({_f(cps['MB_per_s'])} MB/s)")  # fmt: skip
    out += ["#### Absolute figures", "", _table(head, rows), ""]
    out += [f"- {e}" for e in extra] + [""]
    # ratios against every anchor
    fs = [k for k in _fs_keys(results) if S[k].get("available") and "error" not in S[k]]
    anchors = [a for a in ANCHORS if a in S and "error" not in S[a]]
    if fs and anchors:
        head = ["metric", *[f"{S[f]['label']} ÷ {S[a]['label']}" for f in fs for a in anchors]]
        rows = []
        for _key, label, unit, get, hib in metrics(meta["readers"]):
            if unit == "MB" or _key.startswith("remote"):
                continue
            cells = []
            for f in fs:
                for a in anchors:
                    v, w = get(S[f]), get(S[a])
                    r = None
                    if v and w:
                        r = v / w if hib else w / v
                    cells.append(_f(r, "x"))
            if any(c != "–" for c in cells):
                rows.append([label, *cells])
        out += ["#### Ratios against each anchor (same run; >1 = fanstore-fuse faster)", "",
                _table(head, rows), ""]  # fmt: skip
    else:
        out += ["#### Ratios against each anchor", "",
                "n/a: fanstore-fuse was not measured in this run (see above).", ""]  # fmt: skip
    # targets
    rows = []
    for c in results.get("checks", []):
        rows.append([
            c["name"], _f(c["value"], "s" if "time ratio" in c["name"] else ""),
            _f(c["anchor_value"], "s" if "time ratio" in c["name"] else ""),
            _f(c["ratio"], "x"), f"≥ {c['target']:.2f}×" if not c["name"].startswith("ring")
            else "≥ 1.00× (of bound)", f"**{c['status']}**" if c["status"] != "n/a" else "n/a",
        ])  # fmt: skip
    passed = sum(c["status"] == "PASS" for c in results.get("checks", []))
    missed = sum(c["status"] == "MISS" for c in results.get("checks", []))
    nas = sum(c["status"] == "n/a" for c in results.get("checks", []))
    out += [f"#### Targets (issue #5): {passed} PASS, {missed} MISS, {nas} n/a", "",
            _table(["target", "fanstore-fuse", "anchor", "ratio", "target", "status"], rows), ""]  # fmt: skip
    notes = [c for c in results.get("checks", []) if c.get("note") and c["status"] != "n/a"]
    for c in notes:
        out.append(f"- {c['name']}: {c['note']}")
    profs = [(k, spec, p) for k in keys for spec, p in (S[k].get("profiles") or {}).items()]
    if profs:
        out += ["", "#### Profiles (py-spy on the daemons, extra runs; % of active samples)", ""]
        for k, spec, p in profs:
            if "error" in p or not p.get("samples"):
                out.append(f"- {S[k]['label']} `{spec}`: {p.get('error', 'no samples')}")
                continue
            unit = "MB/s" if p.get("unit") == "MB_per_s" else "files/s"
            out.append(f"- **{S[k]['label']} `{spec}`** ({_f(p.get('rate_under_profiler'))} "
                       f"{unit} under the profiler, {p['samples']:,} samples, "
                       f"{p.get('waiting_pct', 0)}% of them parked in epoll/condition waits) "
                       "— self: "
                       + "; ".join(f"{f} {pc}%" for f, pc in p["self"][:8]))  # fmt: skip
            incl = [(f, pc) for f, pc in p["inclusive"] if pc < 99.5][:8]
            out.append("  — inclusive: " + "; ".join(f"{f} {pc}%" for f, pc in incl))
    sm = results.get("scale_model", {})
    out += ["", "#### Scale model", ""]
    if "summary" in sm and sm["summary"]:
        summary = "\n".join(
            ln for ln in sm["summary"].splitlines() if not ln.lstrip().startswith("{")
        )  # the JSON line is in results.json
        out += ["```", f"$ python {sm.get('cmd', '')}", summary[-12000:].strip("\n"), "```"]
    if "error" in sm:
        out.append(f"scale model: {sm['error']}")
    td = results.get("teardown", {})
    out += ["", f"Teardown: {'clean' if not td.get('mounts_left') else 'MOUNTS LEFT: ' + str(td)}"
            f"{'; problems: ' + '; '.join(td['problems']) if td.get('problems') else ''}. "
            f"Run took {meta.get('seconds', 0):.0f} s."]  # fmt: skip
    return "\n".join(out) + "\n"


def update_docs(path: Path, text: str) -> None:
    """Replace the block between the bench markers in docs/performance.md (append if absent)."""
    doc = path.read_text() if path.exists() else "# Performance\n"
    block = f"{DOCS_BEGIN}\n{text.rstrip()}\n{DOCS_END}"
    if DOCS_BEGIN in doc and DOCS_END in doc:
        a = doc.index(DOCS_BEGIN)
        b = doc.index(DOCS_END) + len(DOCS_END)
        doc = doc[:a] + block + doc[b:]
    else:
        doc = doc.rstrip() + "\n\n## Latest results\n\n" + block + "\n"
    path.write_text(doc)


# ---------------------------------------------------------------------------------------------
# plot


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    S = results.get("systems", {})
    keys = [k for k in S if "reads" in S[k]]
    readers = results["meta"]["readers"]
    colors = {"native": "#7f7f7f", "squashfuse": "#1f77b4", "ratarmount": "#ff7f0e",
              "fanstore1": "#2ca02c"}  # fmt: skip
    fig, axes = plt.subplots(2, 2, figsize=(16, 10))
    fig.suptitle(f"fanstore-fuse benchmark ({results['meta']['mode']} mode, "
                 f"{results['meta']['date']}, {results['meta']['cpus']} CPUs)", fontsize=13)  # fmt: skip

    def bars(ax, wl, unit, title, ylabel):
        groups = [(t, r) for t in ("cold", "warm") for r in readers]
        width = 0.8 / max(1, len(keys))
        for i, k in enumerate(keys):
            vals = [_read(S[k], wl, t, r, unit) or 0 for t, r in groups]
            xs = [g + i * width for g in range(len(groups))]
            b = ax.bar(xs, vals, width, label=S[k]["label"], color=colors.get(k, "#d62728"))
            ax.bar_label(b, labels=[_f(v) if v else "" for v in vals], fontsize=6, rotation=90,
                         padding=2)  # fmt: skip
        ax.set_xticks([g + width * (len(keys) - 1) / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{t}\n{r} reader{'s' if r > 1 else ''}" for t, r in groups])
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.margins(y=0.25)

    bars(axes[0, 0], "small", "files_per_s", "small files (~110 KiB): files/s", "files/s (log)")
    bars(axes[0, 1], "large", "MB_per_s", "large files: MB/s", "MB/s (log)")
    axes[0, 0].legend(fontsize=8, loc="upper left")
    mpi = mpi_MBps(results)
    if mpi:
        axes[0, 1].axhline(mpi, color="k", ls="--", lw=1)
        axes[0, 1].text(0, mpi * 1.05, f"raw MPI 4 MiB: {mpi:,.0f} MB/s", fontsize=8)

    ax = axes[1, 0]
    labels = [S[k]["label"] for k in keys]
    stat = [_num(_get(S[k], "stat", "files_per_s")) or 0 for k in keys]
    b = ax.barh(labels, stat, color=[colors.get(k, "#d62728") for k in keys])
    ax.bar_label(b, labels=[f"{v:,.0f}/s" if v else "n/a" for v in stat], fontsize=8, padding=2)
    lsc = [_num(_get(S[k], "ls_cold", "seconds")) for k in keys]
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{lab}\nls -lR cold {_f(v, 's')} s" for lab, v in zip(labels, lsc)],
                       fontsize=8)  # fmt: skip
    ax.set_xscale("log")
    ax.set_title("stat of every file on a fresh mount: files/s")
    ax.margins(x=0.3)
    ax.invert_yaxis()

    ax = axes[1, 1]
    cs = [c for c in results.get("checks", []) if c["status"] != "n/a"]
    if cs:
        vals = [min(c["ratio"] / c["target"], 8) for c in cs]  # capped for display
        b = ax.barh([c["name"] for c in cs], vals,
                    color=["#2ca02c" if c["status"] == "PASS" else "#d62728" for c in cs])  # fmt: skip
        ax.bar_label(b, labels=[f"{c['ratio']:.2f}× (target {c['target']:.1f}×)" for c in cs],
                     fontsize=7, padding=2)  # fmt: skip
        ax.axvline(1.0, color="k", lw=1)
        ax.set_xscale("log")
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()
        ax.margins(x=0.35)
        ax.set_title("targets: measured ratio ÷ target (≥ 1 = PASS)")
    else:
        n_na = len(results.get("checks", []))
        ax.text(0.5, 0.5, f"targets: all {n_na} n/a\n(fanstore-fuse not measured)",
                ha="center", va="center", fontsize=12, transform=ax.transAxes)  # fmt: skip
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
