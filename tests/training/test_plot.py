"""The loss chart: an SVG that parses as XML, whose polylines carry the logged losses in step order, mapped linearly
onto the plot area (loss up, step right), with tick labels that bracket the data."""

from __future__ import annotations

import itertools
import json
import math
import time
import xml.etree.ElementTree as ET

import pytest

from gpt2port.training import plot

NS = {"s": "http://www.w3.org/2000/svg"}


def parse(path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return root


def series(root, name) -> list[tuple[float, float]]:
    lines = root.findall(f".//s:polyline[@class='{name}']", NS)
    if not lines:
        return []
    (line,) = lines
    return [tuple(float(c) for c in p.split(",")) for p in line.get("points").split()]


def ticks(root, axis) -> list[float]:
    return [float(t.text) for t in root.findall(f".//s:g[@class='{axis}-ticks']/s:text", NS)]


def assert_follows(points, logged, tol=0.1):
    """Screen x strictly increasing with the step; screen y an exact falling affine image of the loss (SVG's y
    grows downwards), so the shape on the chart is the shape of the log."""
    assert len(points) == len(logged)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    assert all(a < b for a, b in itertools.pairwise(xs))
    (s0, l0), (s1, l1) = logged[0], logged[-1]
    ax, ay = (xs[-1] - xs[0]) / (s1 - s0), (ys[-1] - ys[0]) / (l1 - l0)
    assert ax > 0 and ay < 0
    for (x, y), (s, v) in zip(points, logged):
        assert x == pytest.approx(xs[0] + ax * (s - s0), abs=tol)
        assert y == pytest.approx(ys[0] + ay * (v - l0), abs=tol)


def test_a_falling_loss_falls_on_the_chart(tmp_path):
    train = [(s, 10 - 6 * s / 200 + 0.3 * math.sin(s)) for s in range(1, 201)]
    evals = [(0, 10.2), (100, 7.1), (200, 4.2)]
    plot.loss_plot(tmp_path / "a.svg", train, evals, title="fine-tuning <gpt2> & co")
    root = parse(tmp_path / "a.svg")
    assert root.get("viewBox") == "0 0 800 480"
    assert root.find("s:title", NS).text == "fine-tuning <gpt2> & co"  # escaped in the file, whole when parsed
    assert_follows(series(root, "train"), train)
    assert_follows(series(root, "eval"), evals)
    assert len(root.findall(".//s:circle[@class='eval']", NS)) == 3
    ema = series(root, "train-ema")
    assert len(ema) == 200 and ema[0][1] < ema[-1][1] - 200  # the running average falls most of the height
    yt, xt = ticks(root, "y"), ticks(root, "x")
    assert yt == sorted(yt) and yt[0] <= 4.2 and yt[-1] >= 10 and len(yt) >= 3
    assert xt == sorted(xt) and xt[0] == 0 and xt[-1] == 200
    # every point inside the plot area (nothing clipped here)
    for x, y in series(root, "train") + series(root, "eval"):
        assert plot.LEFT <= x <= 800 - plot.RIGHT and plot.TOP <= y <= 480 - plot.BOTTOM


def test_a_constant_loss_is_one_horizontal_line_and_no_eval_without_eval(tmp_path):
    plot.loss_plot(tmp_path / "c.svg", [(s, 3.0) for s in range(10)])
    root = parse(tmp_path / "c.svg")
    assert len({y for _, y in series(root, "train")}) == 1
    assert series(root, "eval") == [] and series(root, "train-ema") == []  # the ema only from 30 points
    assert [t.text for t in root.findall(".//s:g[@class='legend']/s:text", NS)] == ["train"]


def test_steps_out_of_order_are_drawn_in_step_order(tmp_path):
    plot.loss_plot(tmp_path / "o.svg", [(3, 1.0), (1, 3.0), (2, 2.0)])
    assert_follows(series(parse(tmp_path / "o.svg"), "train"), [(1, 3.0), (2, 2.0), (3, 1.0)])


def test_nan_single_point_and_empty(tmp_path):
    plot.loss_plot(tmp_path / "n.svg", [(1, 5.0), (2, math.nan), (3, math.inf), (4, 4.0), (5, 4.5)])
    assert_follows(series(parse(tmp_path / "n.svg"), "train"), [(1, 5.0), (4, 4.0), (5, 4.5)])
    plot.loss_plot(tmp_path / "one.svg", [(7, 2.5)])
    root = parse(tmp_path / "one.svg")
    assert len(series(root, "train")) == 1 and len(root.findall(".//s:circle[@class='train']", NS)) == 1
    plot.loss_plot(tmp_path / "none.svg", [])
    root = parse(tmp_path / "none.svg")
    assert root.findall(".//s:polyline", NS) == [] and ticks(root, "x") and ticks(root, "y")  # axes still there


def test_an_early_spike_does_not_flatten_the_rest(tmp_path):
    train = [(s, 11.0 if s < 3 else 3 + 0.5 * math.sin(s / 10)) for s in range(1, 301)]
    plot.loss_plot(tmp_path / "s.svg", train)
    root = parse(tmp_path / "s.svg")
    ys = [y for x, y in series(root, "train")[2:]]
    assert max(ys) - min(ys) > 300  # the wiggle between 2.5 and 3.5 fills most of the 384-pixel height
    assert series(root, "train")[0][1] < plot.TOP  # the spike runs off the top, cut by the clip path
    assert ticks(root, "y")[-1] < 5
    assert any("98th percentile" in (t.text or "") for t in root.iter("{http://www.w3.org/2000/svg}text"))


def test_ten_thousand_points_are_fast_small_and_leave_nothing_else(tmp_path):
    out = tmp_path / "big.svg"
    out.write_bytes(b"old")
    train = [(s, 3 + 5 * math.exp(-s / 500) + 0.1 * math.sin(s)) for s in range(10_000)]
    t0 = time.perf_counter()
    plot.loss_plot(out, train, [(s, 3.5) for s in range(0, 10_000, 250)])
    assert time.perf_counter() - t0 < 0.5
    assert len(series(parse(out), "train")) == 10_000
    assert out.stat().st_size < 500_000
    assert [p.name for p in tmp_path.iterdir()] == ["big.svg"]


@pytest.mark.parametrize("chart", ["loss.svg", "loss.png"])  # loss.png: what runs before the SVG chart drew
def test_a_finished_runs_chart_is_gpt2ports_to_replace(chart, tmp_path):
    from gpt2port import records
    from gpt2port.errors import GPT2PortError
    from gpt2port.fsio import check_replaceable, write_file

    # an earlier version's finished run: its manifest records the run, which claimed its log and chart by name
    (tmp_path / "manifest.json").write_text(json.dumps({"tool": "gpt2port", "saves": [{"finetune": {}}]}))
    (tmp_path / "train_log.jsonl").write_text("{}\n")
    (tmp_path / chart).write_bytes(b"chart")
    check_replaceable(tmp_path, earlier=True)
    # this version's: the run's record lists its log and chart, by content (records.py)
    for f in list(tmp_path.iterdir()):
        f.unlink()
    run = records.RunRecord(tmp_path)
    run.start_log(tmp_path / "train_log.jsonl", "{}\n").close()
    with records.recording(tmp_path) as written:
        write_file(tmp_path / chart, b"chart")
    run.add(written.files)
    check_replaceable(tmp_path)
    (tmp_path / chart).write_bytes(b"CHART")
    with pytest.raises(GPT2PortError, match=rf"{chart} \(changed since gpt2port wrote it"):
        check_replaceable(tmp_path)
