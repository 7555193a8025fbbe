"""The machines page's GPU memory charts, drawn here as SVG (nothing to fetch, no script):
per minute, memory held outside the platform, reserved by the platform, and free, stacked;
every GPU to the same scale, so a bar's height is megabytes wherever it is. Apple unified
memory is the system's own: drawn dashed, and left out of the scale and the totals."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from html import escape

from markupsafe import Markup

from campugrid.coordinator.gpu_history import GpuHistory, Sample, this_minute

SLOT = 6  # px per minute
BAR = 5
FULL = 120  # px for the largest GPU


@dataclasses.dataclass(frozen=True)
class Chart:
    machine_id: str
    name: str
    shared: bool
    latest: Sample
    svg: Markup


def scale_mb(histories: Sequence[GpuHistory]) -> int:
    """The largest GPU's memory: the one scale of every chart (dedicated memory only, unless
    there is none)."""
    counted = [h for h in histories if not h.shared] or list(histories)
    return max((s.total_mb for h in counted for s in h.samples), default=0) or 1


def charts(histories: Sequence[GpuHistory], minutes: int = 60) -> list[Chart]:
    scale = scale_mb(histories)
    now = this_minute()
    return [Chart(h.machine_id, h.name, h.shared, h.samples[-1], _svg(h, scale, now, minutes))
            for h in histories if h.samples]


def _svg(h: GpuHistory, scale: int, now: int, minutes: int) -> Markup:
    px = FULL / scale
    total = max(s.total_mb for s in h.samples)
    height = max(8, round(total * px))
    width = minutes * SLOT
    last = h.samples[-1]
    title = (f"{h.name}: now {last.outside_mb:,} MB held outside the platform, "
             f"{last.reserved_shown_mb:,} MB reserved by it, {last.available_mb:,} MB free, "
             f"of {last.total_mb:,} MB" + (" (unified memory, not counted)" if h.shared else ""))
    parts = [f'<svg class="mem{" shared" if h.shared else ""}" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" role="img" data-scale-mb="{scale}" '
             f'data-total-mb="{total}"><title>{escape(title)}</title>',
             f'<rect class="frame" x="0" y="0" width="{width}" height="{height}"/>']
    for s in h.samples:
        slot = minutes - 1 - (now - s.minute)
        if slot < 0:
            continue
        x = slot * SLOT
        y = float(height)
        for kind, mb in (("outside", s.outside_mb), ("reserved", s.reserved_shown_mb),
                         ("free", s.available_mb)):
            tall = mb * px
            if tall <= 0:
                continue
            y -= tall
            parts.append(f'<rect class="{kind}" x="{x}" y="{y:.2f}" width="{BAR}" '
                         f'height="{tall:.2f}" data-minute="{s.minute}" data-mb="{mb}"/>')
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - built from numbers and escaped text only
