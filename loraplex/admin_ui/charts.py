"""Server-drawn SVG charts: no chart library and no script, so a page shows its numbers as it loads
and a test can read them back (every bar carries its values in a <title> and data attributes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from markupsafe import Markup

WIDTH, HEIGHT = 960, 200
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 8, 12, 28  # margins for the axis labels


@dataclass(frozen=True)
class Series:
    name: str
    css_class: str  # colours live in admin.css
    values: Sequence[int]


def stacked_bars(labels: Sequence[str], series: Sequence[Series], title: str) -> Markup:
    """One bar per label, `series` stacked bottom-up; the y axis runs from 0 to the tallest stack."""
    if any(len(s.values) != len(labels) for s in series):
        raise ValueError("every series needs one value per label")
    totals = [sum(s.values[i] for s in series) for i in range(len(labels))]
    top = max(totals, default=0) or 1
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM
    step = plot_w / max(len(labels), 1)
    bar_w = max(step * 0.8, 1.0)
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
             f'<line class="axis" x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{WIDTH - _RIGHT}" y2="{_TOP + plot_h}"/>',
             f'<text class="tick" x="{_LEFT - 6}" y="{_TOP + 4}" text-anchor="end">{_short(top)}</text>',
             f'<text class="tick" x="{_LEFT - 6}" y="{_TOP + plot_h}" text-anchor="end">0</text>']
    for i, label in enumerate(labels):
        x = _LEFT + i * step + (step - bar_w) / 2
        values = " ".join(f'data-{escape(s.css_class)}="{s.values[i]}"' for s in series)
        tip = f"{label}: " + ", ".join(f"{s.values[i]:,} {s.name}" for s in series)
        parts.append(f'<g class="bar" data-label="{escape(label)}" {values}><title>{escape(tip)}</title>')
        y = _TOP + plot_h
        for s in series:
            h = plot_h * s.values[i] / top
            y -= h
            if h > 0:
                parts.append(f'<rect class="{escape(s.css_class)}" x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" '
                             f'height="{h:.1f}"/>')
        parts.append("</g>")
    for i in sorted({0, len(labels) // 2, len(labels) - 1}) if labels else ():
        x = _LEFT + i * step + step / 2
        anchor = "start" if i == 0 and len(labels) > 1 else "end" if i == len(labels) - 1 > 0 else "middle"
        parts.append(f'<text class="tick" x="{x:.1f}" y="{HEIGHT - 8}" text-anchor="{anchor}">'
                     f'{escape(labels[i])}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _short(n: int) -> str:
    """1234 -> 1.2k, 5600000 -> 5.6M: the axis label of the tallest bar."""
    for size, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return str(n)
