"""Small seeded models the tests lower; a child process rebuilds the same ones by name."""

from __future__ import annotations

import torch

# Registers the custom ops of the "custom_ops" model, in this process and in every child that builds or loads it.
from tests import custom_ops_lib


class AddModel(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class ConvModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, kernel_size=3, padding=1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.conv(image)


class ConvNet(torch.nn.Module):
    """A small image classifier: convolutions with a batch norm, a residual add, pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, kernel_size=3, padding=1)
        self.norm = torch.nn.BatchNorm2d(16)
        self.block = torch.nn.Conv2d(16, 16, kernel_size=3, padding=1)
        self.head = torch.nn.Linear(16, 10)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm(self.stem(image)))
        hidden = torch.relu(hidden + self.block(hidden))
        return self.head(hidden.mean(dim=(2, 3)))


class LinearModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class LinearsOfBothKinds(torch.nn.Module):
    """A linear with a bias and one without, quantized or not by the test."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(64, 32)
        self.second = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class SplitModel(torch.nn.Module):
    """An excluded op (sigmoid) between supported ops, and a second output."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.sigmoid(self.first(x) * 2)
        return self.second(hidden) + 1, hidden.sum(dim=-1)


class SharedModel(torch.nn.Module):
    """Two methods sharing a large encoder, each with its own small head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(256, 512)
        self.classify_head = torch.nn.Linear(512, 4)
        self.score_head = torch.nn.Linear(512, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify_head(torch.relu(self.encoder(x)))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.score_head(torch.tanh(self.encoder(x)))


class UnusedStateModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.unused_weight = torch.nn.Parameter(torch.randn(5))
        self.register_buffer("unused_buffer", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class StackedModel(torch.nn.Module):
    """Linear, activation, normalization and an elementwise tail: something for each engine."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.second = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.nn.functional.gelu(self.first(x)))
        return torch.tanh(self.second(hidden)) * 2 + x[:, :8]


class CondModel(torch.nn.Module):
    """A data-dependent branch between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return torch.cond(y.sum() > 0, lambda t: t.sin(), lambda t: t.cos() * 3, (y,)) + 1


class MapModel(torch.nn.Module):
    """``torch._higher_order_ops.map``, which neither AOTInductor nor the ONNX exporter takes."""

    def forward(self, xs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch._higher_order_ops.map(lambda x, y: x.sin() + y, xs, y) * 2


class Sandwich(torch.nn.Module):
    """Two products, and between them a relu on ``rows`` rows of ``features``: an elementwise op for one engine
    between products for another."""

    def __init__(self, features: int = 512) -> None:
        super().__init__()
        self.first = torch.nn.Parameter(torch.randn(features, features))
        self.second = torch.nn.Parameter(torch.randn(features, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.relu(x) @ self.first) @ self.second


class IslandModel(torch.nn.Module):
    """One add stranded between two sigmoids: an island for ``min_block_size`` to leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        island = torch.sigmoid(torch.relu(self.first(x))) + 1
        return torch.relu(self.second(torch.sigmoid(island)))


class SharedWeightModel(torch.nn.Module):
    """``(x + w) * 2 + w``: one weight read on both sides of the multiply."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.w) * 2 + self.w


class BufferModel(torch.nn.Module):
    """A buffer read by the first op, and a running buffer the method updates."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.arange(6.0))
        self.register_buffer("running", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = x + self.offset
        self.running.mul_(0.5).add_(shifted.mean(dim=0))
        return torch.relu(shifted) + self.running


class MedianModel(torch.nn.Module):
    """A linear layer whose result also feeds ``median``, which needs a fallback kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.relu(self.linear(x))
        return hidden * 2, torch.median(hidden)


class AttentionModel(torch.nn.Module):
    """Convolutions (2-D and 1-D), linear layers, attention, and ``median`` for plain ATen."""

    def __init__(self) -> None:
        super().__init__()
        self.conv2d = torch.nn.Conv2d(3, 4, kernel_size=3, padding=1)
        self.conv1d = torch.nn.Conv1d(4, 8, kernel_size=3, padding=1)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.relu(self.conv2d(image)).flatten(2)  # (N, 4, 64)
        tokens = self.conv1d(features).transpose(1, 2)  # (N, 64, 8)
        q, k, v = self.qkv(tokens).reshape(tokens.shape[0], tokens.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        result = self.out(attended.transpose(1, 2).flatten(2)) + tokens
        return result, torch.median(result)


class AttentionBlock(torch.nn.Module):
    """The attention pattern real models use: SDPA, then ``transpose(1, 2).reshape(b, t, d)``."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden = x + attended.transpose(1, 2).reshape(b, t, d)
        return hidden + self.down(torch.nn.functional.gelu(self.up(hidden)))


class StateKindsModel(torch.nn.Module):
    """Every kind of state: a parameter, a persistent, a non-persistent and a mutated buffer, a lifted constant."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.register_buffer("offset", torch.linspace(-1, 1, 6))
        self.register_buffer("positions", torch.arange(6.0), persistent=False)
        self.register_buffer("calls", torch.zeros(1), persistent=False)
        # A plain attribute: a lifted constant. Read through a view, which Inductor folds at compile time.
        self.scale = torch.tensor([[0.5, 2.0, 1.5, 1.0, 3.0, 0.25], [1.0, 0.75, 2.5, 0.5, 1.25, 2.0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        hidden = torch.sigmoid(self.linear(x) + self.offset) * self.scale[1]
        return torch.relu(hidden + self.positions) * self.calls


class RowsOfFour(torch.nn.Module):
    """Sums each run of four rows: torch.export holds it for row counts divisible by four, and says so in a guard
    rather than in the count's range."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0] // 4, 4, x.shape[1]).sum(1)


class PatchGrid(torch.nn.Module):
    """A vision transformer's patch embedding: it reads its grid's sides off the convolution's output (as Swin and
    SegFormer do), mixes the patches, and lays them out on that grid again."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 16, kernel_size=4, stride=4)
        self.mix = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.patches(x)
        batch, channels, height, width = grid.shape
        tokens = self.mix(grid.flatten(2).transpose(1, 2))
        return tokens.transpose(1, 2).reshape(batch, channels, height, width).relu() * 2


MODELS = {
    "add": (AddModel, [(4, 5), (4, 5)]),
    "conv": (ConvModel, [(2, 3, 8, 8)]),
    "conv_net": (ConvNet, [(1, 3, 16, 16)]),
    "linear": (LinearModel, [(4, 16)]),
    "custom_ops": (custom_ops_lib.CustomOpModel, [(4, 8), (4,)]),
    "split": (SplitModel, [(4, 16)]),
    "shared": (SharedModel, [(2, 256)]),
    "unused": (UnusedStateModel, [(3, 8)]),
    "stacked": (StackedModel, [(4, 16)]),
    "cond": (CondModel, [(3, 8)]),
    "map": (MapModel, [(3, 5), (5,)]),
    "island": (IslandModel, [(2, 8)]),
    "shared_weight": (SharedWeightModel, [(64, 64)]),
    "buffer": (BufferModel, [(2, 6)]),
    "median": (MedianModel, [(3, 8)]),
    "attention": (AttentionModel, [(2, 3, 8, 8)]),
    "attention_block": (AttentionBlock, [(2, 8, 32)]),
    "state_kinds": (StateKindsModel, [(3, 6)]),
    "rows_of_four": (RowsOfFour, [(8, 3)]),
    "patch_grid": (PatchGrid, [(2, 3, 16, 24)]),
}


def build(name: str) -> torch.nn.Module:
    """The model called ``name``, with the same weights in every process."""
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


def example_inputs(name: str, seed: int = 1) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=generator) for shape in MODELS[name][1])
