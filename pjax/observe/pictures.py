"""Pictures of layouts and pipeline tables, drawn on a matplotlib `Axes` (a new figure when none is given)
and returned as the figure; matplotlib is imported when a picture is drawn, never when pjax is."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def _axes(ax: Any, size: tuple[float, float]) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    if ax is not None:
        return ax.figure, ax
    return plt.subplots(figsize=size)


def save(fig: Any, path: str) -> None:
    """Write `fig` as a PNG and release it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def device_blocks(sharding: Any, shape: Sequence[int], dims: tuple[int, int] = (-2, -1)
                  ) -> dict[tuple[int, int, int, int], list[int]]:
    """{(row0, row1, col0, col1): device ids holding that block} over two dimensions of a tensor
    of `shape` laid out by `sharding` (a replicated block lists every device that holds a copy)."""
    shape = tuple(shape) if len(shape) > 1 else (1, *shape)
    a, b = (d % len(shape) for d in dims)
    blocks: dict[tuple[int, int, int, int], list[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        index = index if len(index) == len(shape) else (slice(None), *index)
        rows, cols = (range(*index[d].indices(shape[d])) for d in (a, b))
        blocks.setdefault((rows.start, rows.stop, cols.start, cols.stop), []).append(device.id)
    return {k: sorted(v) for k, v in sorted(blocks.items())}


def draw_sharding(sharding: Any, shape: Sequence[int], title: str = "", ax: Any = None,
                  dims: tuple[int, int] = (-2, -1)) -> Any:
    """Draw the tensor's two `dims` as a grid of blocks, each labelled with the devices holding it."""
    import matplotlib.pyplot as plt

    blocks = device_blocks(sharding, shape, dims)
    fig, ax = _axes(ax, (3.2, 3.2))
    colors = plt.get_cmap("tab10")
    for k, ((r0, r1, c0, c1), devices) in enumerate(blocks.items()):
        ax.add_patch(plt.Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=colors(k % 10), alpha=0.55,
                                   edgecolor="black"))
        label = ",".join(map(str, devices)) if len(devices) <= 4 else f"{devices[0]}..{devices[-1]} ({len(devices)})"
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=8)
    rows, cols = max(k[1] for k in blocks), max(k[3] for k in blocks)
    ax.set(xlim=(0, cols), ylim=(rows, 0), xticks=[], yticks=[])
    ax.set_title(title or f"{list(shape)}", fontsize=9)
    return fig


def draw_schedule(sched: Any, ax: Any = None) -> Any:
    """Draw a pipeline table: devices down, ticks across, one box per item with its micro-batch (blue
    forward, green backward, orange weight gradients when split from it, darker = later chunk)."""
    import matplotlib.pyplot as plt

    fig, ax = _axes(ax, (max(6.0, 0.32 * sched.ticks), 0.5 * sched.p + 1.0))
    maps = [None, plt.get_cmap("Blues"), plt.get_cmap("Greens"), plt.get_cmap("Oranges")]  # by op
    for t, s in zip(*np.nonzero(sched.op)):
        shade = 0.45 + 0.4 * sched.chunk[t, s] / max(sched.v - 1, 1)
        color = maps[sched.op[t, s]](shade)
        ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=color, edgecolor="white"))
        ax.text(t + 0.5, s + 0.5, str(sched.mb[t, s]), ha="center", va="center", fontsize=7, color="white")
    ax.set(xlim=(0, sched.ticks), ylim=(sched.p, 0), xlabel="tick", ylabel="device",
           yticks=[s + 0.5 for s in range(sched.p)], yticklabels=[str(s) for s in range(sched.p)])
    ax.set_title(f"{sched.name}: p={sched.p} m={sched.m} v={sched.v}, bubble {sched.bubble_fraction():.3f}",
                 fontsize=9)
    return fig


def plot_schedule(sched: Any, path: str) -> None:
    """Save a pipeline schedule's table (`pipeline.schedules.Schedule`) as a PNG."""
    save(draw_schedule(sched), path)
