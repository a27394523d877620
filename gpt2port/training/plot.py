"""The loss chart of a fine-tuning run, drawn into a pixel array and written as a PNG by hand: plotting libraries
are heavy dependencies for one picture, and PNG is a few chunks of zlib data with CRCs.

Training loss is a light line with its running average (EMA) drawn over it; held-out loss is a second colour with
a marker per evaluation. When the first steps are far above the rest (loss 11 falling to 3, typically) the y-axis
stops near the 98th percentile so the part that matters is visible, and the chart says so.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np

from gpt2port.fsio import write_file

WHITE, INK, GRID = (255, 255, 255), (40, 40, 40), (228, 228, 228)
TRAIN, SMOOTH, EVAL = (170, 196, 230), (31, 100, 180), (220, 90, 20)
SCALE = 2  # font pixels per glyph pixel
LEFT, RIGHT, TOP, BOTTOM = 78, 20, 56, 46

# 5x7 glyphs, one string of seven 5-bit rows per character; unknown characters draw as a box.
_GLYPHS = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "a": "00000 00000 01110 00001 01111 10001 01111", "b": "10000 10000 10110 11001 10001 10001 11110",
    "c": "00000 00000 01110 10000 10000 10001 01110", "d": "00001 00001 01101 10011 10001 10001 01111",
    "e": "00000 00000 01110 10001 11111 10000 01110", "f": "00110 01001 01000 11100 01000 01000 01000",
    "g": "00000 01111 10001 10001 01111 00001 01110", "h": "10000 10000 10110 11001 10001 10001 10001",
    "i": "00100 00000 01100 00100 00100 00100 01110", "j": "00010 00000 00110 00010 00010 10010 01100",
    "k": "10000 10000 10010 10100 11000 10100 10010", "l": "01100 00100 00100 00100 00100 00100 01110",
    "m": "00000 00000 11010 10101 10101 10001 10001", "n": "00000 00000 10110 11001 10001 10001 10001",
    "o": "00000 00000 01110 10001 10001 10001 01110", "p": "00000 00000 11110 10001 11110 10000 10000",
    "q": "00000 00000 01101 10011 01111 00001 00001", "r": "00000 00000 10110 11001 10000 10000 10000",
    "s": "00000 00000 01110 10000 01110 00001 11110", "t": "01000 01000 11100 01000 01000 01001 00110",
    "u": "00000 00000 10001 10001 10001 10011 01101", "v": "00000 00000 10001 10001 10001 01010 00100",
    "w": "00000 00000 10001 10001 10101 10101 01010", "x": "00000 00000 10001 01010 00100 01010 10001",
    "y": "00000 00000 10001 10001 01111 00001 01110", "z": "00000 00000 11111 00010 00100 01000 11111",
    ".": "00000 00000 00000 00000 00000 01100 01100", "-": "00000 00000 00000 11111 00000 00000 00000",
    "_": "00000 00000 00000 00000 00000 00000 11111", ":": "00000 01100 01100 00000 01100 01100 00000",
    "/": "00001 00010 00010 00100 01000 01000 10000", "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000", "+": "00000 00100 00100 11111 00100 00100 00000",
    "=": "00000 00000 11111 00000 11111 00000 00000", "%": "11000 11001 00010 00100 01000 10011 00011",
    " ": "00000 00000 00000 00000 00000 00000 00000", "?": "11111 10001 10001 10001 10001 10001 11111",
}
_BITMAPS = {ch: np.array([[c == "1" for c in row] for row in rows.split()], dtype=bool) for ch, rows in _GLYPHS.items()}


class Canvas:
    def __init__(self, width: int, height: int):
        self.px = np.full((height, width, 3), WHITE, dtype=np.uint8)
        self.w, self.h = width, height

    def rect(self, x0, y0, x1, y1, color) -> None:
        self.px[max(0, y0) : max(0, y1), max(0, x0) : max(0, x1)] = color

    def text(self, x: int, y: int, s: str, color=INK, anchor: str = "left") -> None:
        """Text with its top at y; anchor left, right or center on x."""
        width = len(s) * 6 * SCALE - SCALE
        x = {"left": x, "right": x - width, "center": x - width // 2}[anchor]
        x = min(max(x, 0), self.w - width)  # a label at the edge (the last tick's) moves in rather than being cut
        for i, ch in enumerate(s):
            glyph = _BITMAPS.get(ch.lower(), _BITMAPS["?"])
            big = np.kron(glyph, np.ones((SCALE, SCALE), dtype=bool))
            gx = x + i * 6 * SCALE
            region = self.px[y : y + big.shape[0], gx : gx + big.shape[1]]
            region[big[: region.shape[0], : region.shape[1]]] = color

    def polyline(self, xs: np.ndarray, ys: np.ndarray, color, thick: int = 1) -> None:
        """Segments between consecutive points, every one at once: a sample per pixel of each segment's length."""
        if len(xs) == 1:
            self.dot(xs, ys, color, 1)
            return
        x0, y0, dx, dy = xs[:-1], ys[:-1], np.diff(xs), np.diff(ys)
        n = np.maximum(np.abs(dx), np.abs(dy)).astype(np.int64) + 1
        seg = np.repeat(np.arange(len(n)), n)
        t = (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)) / np.maximum(n - 1, 1)[seg]
        self._plot(np.rint(x0[seg] + t * dx[seg]), np.rint(y0[seg] + t * dy[seg]), color, thick)

    def dot(self, xs, ys, color, radius: int = 3) -> None:
        # centres rounded once, then whole-pixel offsets (rounding each offset point on its own, half to even,
        # would leave gaps when a centre falls on .5)
        cx, cy = np.floor(np.asarray(xs) + 0.5), np.floor(np.asarray(ys) + 0.5)
        for ox in range(-radius, radius + 1):
            for oy in range(-radius, radius + 1):
                if ox * ox + oy * oy <= radius * radius + 1:
                    self._plot(cx + ox, cy + oy, color, 1)

    def _plot(self, x, y, color, thick: int) -> None:
        for k in range(thick):
            xi, yi = x.astype(np.int64), y.astype(np.int64) + k
            ok = (xi >= 0) & (xi < self.w) & (yi >= 0) & (yi < self.h)
            self.px[yi[ok], xi[ok]] = color

    def png(self) -> bytes:
        raw = np.concatenate([np.zeros((self.h, 1), np.uint8), self.px.reshape(self.h, -1)], axis=1)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
                + chunk(b"IEND", b""))


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


def _ema(values: np.ndarray, alpha: float) -> np.ndarray:
    out, acc = np.empty_like(values), values[0]
    for i, v in enumerate(values):  # a few thousand points: plain Python is fast enough, and exact
        acc = alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def loss_plot(path: Path, train, eval=(), title: str = "", width: int = 800, height: int = 480) -> None:
    """Write a PNG line chart of training loss [(step, loss)] and held-out loss [(step, loss)], atomically."""
    tr = np.array([p for p in train if math.isfinite(p[1])], dtype=np.float64).reshape(-1, 2)
    ev = np.array([p for p in eval if math.isfinite(p[1])], dtype=np.float64).reshape(-1, 2)
    c = Canvas(width, height)
    x0, x1, y0, y1 = LEFT, width - RIGHT, TOP, height - BOTTOM
    both = np.concatenate([tr, ev])
    note = ""
    if len(both):
        xlo, xhi = both[:, 0].min(), both[:, 0].max()
        ylo, yhi = both[:, 1].min(), both[:, 1].max()
        q = np.percentile(both[:, 1], 98)
        if len(both) >= 20 and yhi - q > q - ylo:  # a few early points would flatten everything else
            yhi, note = q + 0.1 * (q - ylo), "y clipped at 98th pct"
        pad = 0.05 * (yhi - ylo) or 0.5
        ylo, yhi = ylo - pad, yhi + pad
        xhi = xhi if xhi > xlo else xlo + 1
    else:
        xlo, xhi, ylo, yhi = 0.0, 1.0, 0.0, 1.0

    def sx(v):
        return x0 + (np.asarray(v) - xlo) / (xhi - xlo) * (x1 - x0)

    def sy(v):
        return np.clip(y1 - (np.asarray(v) - ylo) / (yhi - ylo) * (y1 - y0), y0, y1)

    yt, xt = nice_ticks(ylo, yhi), nice_ticks(xlo, xhi, 6)
    for v in yt:
        y = int(sy(v))
        c.rect(x0, y, x1, y + 1, GRID)
        c.text(x0 - 8, y - 7, _label(v, yt), anchor="right")
    for v in xt:
        x = int(sx(v))
        c.rect(x, y0, x + 1, y1, GRID)
        c.text(x, y1 + 8, _label(v, xt), anchor="center")
    c.rect(x0, y0, x0 + 1, y1 + 1, INK)
    c.rect(x0, y1, x1, y1 + 1, INK)
    c.text(x0, 10, title[: (x1 - x0) // 12 - (len(note) + 2 if note else 0)])
    c.text((x0 + x1) // 2, height - 18, "step", anchor="center")
    c.text(x0 + 6, y0 - 20, "loss")
    if note:
        c.text(x1, 10, note, (120, 120, 120), anchor="right")
    legend = []
    if len(tr):
        c.polyline(sx(tr[:, 0]), sy(tr[:, 1]), TRAIN)
        legend.append(("train", TRAIN))
        if len(tr) >= 30:
            c.polyline(sx(tr[:, 0]), sy(_ema(tr[:, 1], 2 / (1 + min(100, len(tr) // 10)))), SMOOTH, thick=2)
            legend.append(("train (ema)", SMOOTH))
    if len(ev):
        c.polyline(sx(ev[:, 0]), sy(ev[:, 1]), EVAL, thick=2)
        c.dot(sx(ev[:, 0]), sy(ev[:, 1]), EVAL)
        legend.append(("eval", EVAL))
    for i, (name, color) in enumerate(legend):
        y = y0 + 10 + i * 22
        c.rect(x1 - 190, y + 6, x1 - 160, y + 9, color)
        c.text(x1 - 150, y, name)
    write_file(Path(path), c.png())
