"""Custom ops as a user's project defines them with ``torch.library``: one pure, one writing into a buffer.

Importing this module registers them; a process that loads a package calling them imports it first.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("aotstack_custom::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * scale[:, None]


@scale_rows.register_fake
def _(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("aotstack_custom::accumulate", mutates_args=("total",))
def accumulate(total: torch.Tensor, x: torch.Tensor) -> None:
    total.add_(x)


@accumulate.register_fake
def _(total: torch.Tensor, x: torch.Tensor) -> None:
    return None


class CustomOpModel(torch.nn.Module):
    """Scales rows with one custom op and adds the result into a running total with the other."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aotstack_custom.scale_rows(torch.relu(x), scale) + 1
        torch.ops.aotstack_custom.accumulate(self.total, y)
        return y * 2 + self.total


# torch's thread count at each call of threads_seen: what an ATen call at that point would run on.
THREADS_SEEN: list[int] = []


@torch.library.custom_op("aotstack_custom::threads_seen", mutates_args=())
def threads_seen(x: torch.Tensor) -> torch.Tensor:
    THREADS_SEEN.append(torch.get_num_threads())
    return x.clone()


@threads_seen.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
