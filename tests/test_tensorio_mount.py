"""tensorio files read back through a real fanstore-fuse mount, by every CPU read tool."""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import prep_cli

torch = pytest.importorskip("torch")

from fanstore_fuse import tensorio as tio  # noqa: E402

pytestmark = [pytest.mark.tensor, pytest.mark.mount, pytest.mark.timeout(120)]


def test_load_through_mount_every_tool(tmp_path: Path, mount_factory, monkeypatch):
    monkeypatch.setenv(tio.ENV_DB, "off")
    tio.set_default_selector(None)
    src = tmp_path / "src"
    (src / "ckpt").mkdir(parents=True)
    g = torch.Generator().manual_seed(3)
    sd = {
        "w": torch.randn(700, 1000, generator=g),  # 2.8 MB: spans several 1 MiB chunks
        "b": torch.randn(7, generator=g).bfloat16(),
        "m": torch.tensor([True, False]),
        "step": 12,
    }
    tio.save(sd, src / "ckpt" / "model.fst")
    tio.save({"x": torch.arange(10, dtype=torch.int8)}, src / "small.fst")
    dest = prep_cli(src, tmp_path / "dest", "-p", "2", "--chunk-mib", "1")
    m = mount_factory(dest, local=tmp_path / "local")
    p = m.path / "ckpt" / "model.fst"
    assert tio.fs_type(p).startswith("fuse")
    names = tio.eligible("read", "cpu", str(p))
    assert {"pread", "mmap", "torch", "safetensors"} <= set(names)
    for tool in names:
        out = tio.load(p, tool=tool)
        assert out["step"] == 12
        for k in ("w", "b", "m"):
            assert torch.equal(out[k], sd[k]), (tool, k)
    sel = tio.Selector(None, stamp={})
    for _ in range(2 * len(names) + 2):
        tio.load(p, selector=sel)
    assert any("|fuse" in k for k in sel.entries)
    assert torch.equal(tio.load(m.path / "small.fst")["x"], torch.arange(10, dtype=torch.int8))
