"""Synthetic state dicts with real model shapes (no weights are downloaded)."""

from __future__ import annotations

import collections

import torch


def _bn(sd: dict, name: str, c: int, g: torch.Generator) -> None:
    sd[f"{name}.weight"] = torch.rand(c, generator=g)
    sd[f"{name}.bias"] = torch.randn(c, generator=g)
    sd[f"{name}.running_mean"] = torch.randn(c, generator=g)
    sd[f"{name}.running_var"] = torch.rand(c, generator=g)
    sd[f"{name}.num_batches_tracked"] = torch.tensor(0)


def resnet50_state_dict(seed: int = 0) -> collections.OrderedDict:
    """torchvision ResNet-50's state dict shapes: 25.6 M parameters, 320 tensors, ~102 MB."""
    g = torch.Generator().manual_seed(seed)
    sd: collections.OrderedDict = collections.OrderedDict()
    sd["conv1.weight"] = torch.randn(64, 3, 7, 7, generator=g)
    _bn(sd, "bn1", 64, g)
    cin = 64
    for li, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True), 1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            sd[f"{p}.conv1.weight"] = torch.randn(width, cin, 1, 1, generator=g)
            _bn(sd, f"{p}.bn1", width, g)
            sd[f"{p}.conv2.weight"] = torch.randn(width, width, 3, 3, generator=g)
            _bn(sd, f"{p}.bn2", width, g)
            sd[f"{p}.conv3.weight"] = torch.randn(width * 4, width, 1, 1, generator=g)
            _bn(sd, f"{p}.bn3", width * 4, g)
            if b == 0:
                sd[f"{p}.downsample.0.weight"] = torch.randn(width * 4, cin, 1, 1, generator=g)
                _bn(sd, f"{p}.downsample.1", width * 4, g)
            cin = width * 4
    sd["fc.weight"] = torch.randn(1000, 2048, generator=g)
    sd["fc.bias"] = torch.randn(1000, generator=g)
    return sd


def gpt_state_dict(layers: int = 9, d: int = 2048, vocab: int = 16384, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> collections.OrderedDict:
    """A GPT-style decoder: 9 layers, d=2048, vocab 16k, fp32: ~1.04 GB in 110 tensors."""
    g = torch.Generator().manual_seed(seed)
    sd: collections.OrderedDict = collections.OrderedDict()
    sd["wte.weight"] = torch.randn(vocab, d, generator=g).to(dtype)
    for i in range(layers):
        p = f"h.{i}"
        sd[f"{p}.ln_1.weight"] = torch.ones(d, dtype=dtype)
        sd[f"{p}.ln_1.bias"] = torch.zeros(d, dtype=dtype)
        sd[f"{p}.attn.c_attn.weight"] = torch.randn(d, 3 * d, generator=g).to(dtype)
        sd[f"{p}.attn.c_attn.bias"] = torch.zeros(3 * d, dtype=dtype)
        sd[f"{p}.attn.c_proj.weight"] = torch.randn(d, d, generator=g).to(dtype)
        sd[f"{p}.attn.c_proj.bias"] = torch.zeros(d, dtype=dtype)
        sd[f"{p}.ln_2.weight"] = torch.ones(d, dtype=dtype)
        sd[f"{p}.ln_2.bias"] = torch.zeros(d, dtype=dtype)
        sd[f"{p}.mlp.c_fc.weight"] = torch.randn(d, d, generator=g).to(dtype)
        sd[f"{p}.mlp.c_fc.bias"] = torch.zeros(d, dtype=dtype)
        sd[f"{p}.mlp.c_proj.weight"] = torch.randn(d, d, generator=g).to(dtype)
        sd[f"{p}.mlp.c_proj.bias"] = torch.zeros(d, dtype=dtype)
    sd["ln_f.weight"] = torch.ones(d, dtype=dtype)
    return sd


def nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))


def small_cnn() -> torch.nn.Module:
    """A small CNN whose feature maps dominate memory (for the offload bench)."""
    torch.manual_seed(0)
    c = 32
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
        torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
        torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(c, 10),
    )
