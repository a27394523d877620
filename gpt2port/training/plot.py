"""The loss chart of a fine-tuning run, as a small SVG file: plain text any browser shows, no plotting dependency.

Training loss is a light line with its running average (EMA) drawn over it; held-out loss is a second colour with
a marker per evaluation. The points are the logged numbers mapped linearly onto the plot area and cut to it by a
clip path. When the first steps are far above the rest (loss 11 falling to 3, typically) the y-axis stops near the
98th percentile so the part that matters is visible, and the chart says so.
"""

from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

from gpt2port.fsio import write_file

INK, GRID, NOTE = "#282828", "#e4e4e4", "#787878"
TRAIN, SMOOTH, EVAL = "#aac4e6", "#1f64b4", "#dc5a14"
LEFT, RIGHT, TOP, BOTTOM = 64, 20, 48, 48


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / count
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float, ticks: list[float]) -> str:
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step))) if step > 0 else 0
    return f"{v:.{decimals}f}" if abs(v) < 1e6 else f"{v:.1e}"


def _ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], values[0]
    for v in values:
        acc = alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the two nearest ranks (numpy's default)."""
    s = sorted(values)
    at = q / 100 * (len(s) - 1)
    i = min(int(at), len(s) - 2) if len(s) > 1 else 0
    return s[i] + (at - i) * (s[min(i + 1, len(s) - 1)] - s[i])


def _points(xs, ys) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))


def loss_plot(path: Path, train, eval=(), title: str = "", width: int = 800, height: int = 480) -> None:
    """Write an SVG line chart of training loss [(step, loss)] and held-out loss [(step, loss)]; points whose loss
    is not finite are left out."""
    tr = sorted((float(s), float(v)) for s, v in train if math.isfinite(v))
    ev = sorted((float(s), float(v)) for s, v in eval if math.isfinite(v))
    x0, x1, y0, y1 = LEFT, width - RIGHT, TOP, height - BOTTOM
    both = tr + ev
    note = ""
    if both:
        steps, losses = [p[0] for p in both], [p[1] for p in both]
        xlo, xhi, ylo, yhi = min(steps), max(steps), min(losses), max(losses)
        q = _percentile(losses, 98)
        if len(both) >= 20 and yhi - q > q - ylo:  # a few early points would flatten everything else
            yhi, note = q + 0.1 * (q - ylo), "y axis cut at the 98th percentile"
        pad = 0.05 * (yhi - ylo) or 0.5
        ylo, yhi = ylo - pad, yhi + pad
        xhi = xhi if xhi > xlo else xlo + 1
    else:
        xlo, xhi, ylo, yhi = 0.0, 1.0, 0.0, 1.0

    def sx(v: float) -> float:
        return x0 + (v - xlo) / (xhi - xlo) * (x1 - x0)

    def sy(v: float) -> float:
        return y1 - (v - ylo) / (yhi - ylo) * (y1 - y0)

    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" fill="{INK}">'),
           f"<title>{escape(title or 'loss')}</title>",
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<clipPath id="plot"><rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}"/></clipPath>']
    yt, xt = nice_ticks(ylo, yhi), nice_ticks(xlo, xhi, 6)
    out.append(f'<g class="y-ticks" stroke="{GRID}">')
    for v in yt:
        out.append(f'<line x1="{x0}" x2="{x1}" y1="{sy(v):.1f}" y2="{sy(v):.1f}"/>'
                   f'<text x="{x0 - 6}" y="{sy(v) + 4:.1f}" text-anchor="end" stroke="none">{_label(v, yt)}</text>')
    out.append(f'</g>\n<g class="x-ticks" stroke="{GRID}">')
    for v in xt:
        out.append(f'<line x1="{sx(v):.1f}" x2="{sx(v):.1f}" y1="{y0}" y2="{y1}"/>'
                   f'<text x="{sx(v):.1f}" y="{y1 + 18}" text-anchor="middle" stroke="none">{_label(v, xt)}</text>')
    out.append("</g>")
    out.append(f'<path class="axes" d="M{x0},{y0}V{y1}H{x1}" fill="none" stroke="{INK}"/>')
    out.append(f'<text x="{x0}" y="24" font-size="14">{escape(title)}</text>')
    out.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{height - 10}" text-anchor="middle">step</text>')
    out.append(f'<text x="{x0 - 6}" y="{y0 - 12}" text-anchor="end">loss</text>')
    if note:
        out.append(f'<text x="{x1}" y="24" text-anchor="end" fill="{NOTE}">{note}</text>')

    series = []  # (class, colour, stroke width, xs, ys)
    if tr:
        series.append(("train", TRAIN, 1, [p[0] for p in tr], [p[1] for p in tr]))
        if len(tr) >= 30:
            smooth = _ema([p[1] for p in tr], 2 / (1 + min(100, len(tr) // 10)))
            series.append(("train-ema", SMOOTH, 2, [p[0] for p in tr], smooth))
    if ev:
        series.append(("eval", EVAL, 2, [p[0] for p in ev], [p[1] for p in ev]))
    out.append('<g clip-path="url(#plot)" fill="none">')
    for name, colour, thick, xs, ys in series:
        px, py = [sx(v) for v in xs], [sy(v) for v in ys]
        out.append(f'<polyline class="{name}" stroke="{colour}" stroke-width="{thick}" '
                   f'stroke-linejoin="round" points="{_points(px, py)}"/>')
        if name == "eval" or len(px) == 1:  # a marker per evaluation; a lone point is a marker too
            out.extend(f'<circle class="{name}" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>'
                       for x, y in zip(px, py))
    out.append("</g>")
    if series:  # the legend sits in the top right corner, over a white box so lines passing under it stay apart
        out.append(f'<rect x="{x1 - 208}" y="{y0 + 2}" width="204" height="{20 * len(series) + 6}" fill="white" '
                   f'fill-opacity="0.85"/>')
    for i, (name, colour, *_) in enumerate(series):
        y = y0 + 14 + i * 20
        label = {"train": "train", "train-ema": "train (running average)", "eval": "eval"}[name]
        out.append(f'<g class="legend"><line x1="{x1 - 200}" x2="{x1 - 172}" y1="{y - 4}" y2="{y - 4}" '
                   f'stroke="{colour}" stroke-width="3"/><text x="{x1 - 164}" y="{y}">{label}</text></g>')
    out.append("</svg>\n")
    write_file(Path(path), "\n".join(out).encode("utf-8"))
