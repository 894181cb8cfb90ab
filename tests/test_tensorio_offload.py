"""tensorio's feature-map offload: gradients identical to a run without it, forced tools, its
directory created and cleaned up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fanstore_fuse import tensorio as tio  # noqa: E402

pytestmark = [pytest.mark.tensor, pytest.mark.timeout(120), pytest.mark.usefixtures("tensorio_isolated")]


# ------------------------------------------------------------------------- offload


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 16 * 16, 10),
    )


def _grads(offload_dir: Path | None):
    m = _model()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    if offload_dir is None:
        loss = m(x).square().sum()
        loss.backward()
        stats = None
    else:
        with tio.offload(offload_dir, threshold=4096, prefetch=2) as off:
            loss = m(x).square().sum()
            loss.backward()
        stats = off.stats
    return loss.detach(), [p.grad.clone() for p in m.parameters()], stats


def test_offload_gives_identical_gradients(tmp_path: Path):
    loss0, g0, _ = _grads(None)
    loss1, g1, stats = _grads(tmp_path)
    assert stats["offloaded"] >= 3 and stats["kept"] >= 1
    assert stats["prefetch_hits"] >= 1
    assert torch.equal(loss0, loss1)
    for a, b in zip(g0, g1, strict=True):
        assert torch.equal(a, b)
    assert os.listdir(tmp_path) == []  # files and directory removed on exit


def test_offload_with_forced_tools(tmp_path: Path):
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    x = torch.randn(32, 64)
    m(x).sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    with tio.offload(tmp_path, threshold=1024, tool_write="mmap", tool_read="odirect") as off:
        m(x).sum().backward()
    assert off.stats["offloaded"] >= 2
    for a, p in zip(want, m.parameters(), strict=True):
        assert torch.equal(a, p.grad)


def test_offload_creates_its_directory_and_cleans_up(tmp_path: Path):
    target = tmp_path / "not" / "yet"
    loss0, g0, _ = _grads(None)
    loss1, g1, stats = _grads(target)
    assert stats["offloaded"] >= 1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert target.is_dir() and not any(target.iterdir())
