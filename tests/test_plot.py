"""The loss chart: a valid PNG (decoded here by hand: chunks, CRCs, scanline filters) whose coloured pixels lie
where the data says."""

from __future__ import annotations

import math
import shutil
import struct
import subprocess
import time
import zlib

import numpy as np
import pytest

from gpt2port.training import plot


def decode(path) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    i, idat, kinds = 8, b"", []
    while i < len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        kind, body = data[i + 4 : i + 8], data[i + 8 : i + 8 + n]
        assert struct.unpack(">I", data[i + 8 + n : i + 12 + n])[0] == zlib.crc32(kind + body)
        kinds.append(kind)
        if kind == b"IHDR":
            w, h, depth, colour = struct.unpack(">IIBB", body[:10])
            assert (depth, colour) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        i += 12 + n
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()  # filter type None on every scanline
    return rows[:, 1:].reshape(h, w, 3)


def where(img: np.ndarray, colour) -> tuple[np.ndarray, np.ndarray]:
    ys, xs = np.nonzero((img == np.array(colour, np.uint8)).all(axis=2))
    return xs, ys


def test_a_falling_loss_falls_on_the_chart(tmp_path):
    train = [(s, 10 - 6 * s / 200) for s in range(1, 201)]
    plot.loss_plot(tmp_path / "a.png", train, [(0, 10.2), (100, 7.1), (200, 4.2)], title="run")
    img = decode(tmp_path / "a.png")
    assert img.shape == (480, 800, 3)
    xs, ys = where(img, plot.SMOOTH)
    left, right = ys[xs < xs.min() + 100].mean(), ys[xs > xs.max() - 100].mean()
    assert left < right - 200  # high loss near the top on the left, low near the bottom on the right
    assert len(where(img, plot.EVAL)[0]) > 50 and len(where(img, plot.TRAIN)[0]) > 100


def test_a_constant_loss_is_one_horizontal_line_and_no_eval_colour_without_eval(tmp_path):
    plot.loss_plot(tmp_path / "c.png", [(s, 3.0) for s in range(10)])
    img = decode(tmp_path / "c.png")
    xs, ys = where(img, plot.TRAIN)
    assert len(set(ys[(xs > plot.LEFT + 5) & (xs < 800 - plot.RIGHT - 200)])) == 1
    assert len(where(img, plot.EVAL)[0]) == 0


def test_nan_single_point_and_empty(tmp_path):
    plot.loss_plot(tmp_path / "n.png", [(1, 5.0), (2, math.nan), (3, math.inf), (4, 4.0)])
    assert len(where(decode(tmp_path / "n.png"), plot.TRAIN)[0]) > 10
    plot.loss_plot(tmp_path / "one.png", [(7, 2.5)])
    assert len(where(decode(tmp_path / "one.png"), plot.TRAIN)[0]) >= 1
    plot.loss_plot(tmp_path / "none.png", [])
    img = decode(tmp_path / "none.png")
    assert len(where(img, plot.TRAIN)[0]) == 0 and len(where(img, plot.INK)[0]) > 500  # axes and labels


def test_an_early_spike_does_not_flatten_the_rest(tmp_path):
    train = [(s, 11.0 if s < 3 else 3 + 0.5 * math.sin(s / 10)) for s in range(1, 301)]
    plot.loss_plot(tmp_path / "s.png", train)
    xs, ys = where(decode(tmp_path / "s.png"), plot.TRAIN)
    later = ys[xs > plot.LEFT + 60]
    assert later.max() - later.min() > 200  # the wiggle between 2.5 and 3.5 fills most of the height


def test_ten_thousand_points_are_fast_and_the_write_is_atomic(tmp_path):
    out = tmp_path / "big.png"
    out.write_bytes(b"old")
    train = [(s, 3 + 5 * math.exp(-s / 500) + 0.1 * math.sin(s)) for s in range(10_000)]
    t0 = time.perf_counter()
    plot.loss_plot(out, train, [(s, 3.5) for s in range(0, 10_000, 250)])
    assert time.perf_counter() - t0 < 0.5
    decode(out)
    assert [p.name for p in tmp_path.iterdir()] == ["big.png"]


def test_a_second_decoder_agrees(tmp_path):
    if shutil.which("file") is None:
        pytest.skip("no `file` command here")
    plot.loss_plot(tmp_path / "f.png", [(1, 2.0), (2, 1.0)])
    assert "PNG image data, 800 x 480, 8-bit/color RGB" in subprocess.run(
        ["file", tmp_path / "f.png"], capture_output=True, text=True).stdout
