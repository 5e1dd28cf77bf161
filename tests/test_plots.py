"""Plots a person can read: a warm-up spike does not black out a heatmap, names are whole."""

from __future__ import annotations

import numpy as np

from fp8sim.analysis.plots import color_limit, plot_heatmap, plot_policy_summary, wrap_name


def test_a_warm_up_spike_does_not_set_the_colour_scale():
    rng = np.random.default_rng(0)
    m = rng.uniform(0.0, 0.5, (20, 300))
    m[:, 0] = 93.0  # step 1 of delayed scaling: scale 1, nearly everything underflows
    top, above = color_limit(m)
    assert 0.45 < top <= 0.5  # the 99th percentile of the other cells, not 93
    assert above == int(np.count_nonzero(m > top)) and 20 <= above <= 80


def test_no_clipping_without_outliers_and_nan_ignored():
    m = np.array([[0.0, 1.0, np.nan], [2.0, 3.0, 4.0]])
    top, above = color_limit(m, quantile=1.0)
    assert (top, above) == (4.0, 0)
    assert color_limit(np.full((2, 2), np.nan)) == (1.0, 0)
    assert color_limit(np.zeros((3, 3))) == (1.0, 0)


def test_names_are_wrapped_never_cut():
    name = "model.layers.12.self_attn.q_proj.weight_grad_with_a_long_suffix_" + "x" * 70
    text = wrap_name(name, 48)
    assert text.replace("\n", "") == name
    assert all(len(line) <= 48 for line in text.split("\n"))
    a, b = "delayed:history=16,algo=max,margin=0", "delayed:history=16,algo=max,margin=1"
    assert wrap_name(a, 30) != wrap_name(b, 30)  # the ending that tells them apart is kept


def test_plots_are_written(tmp_path):
    names = [f"model.layers.{i}.mlp.down_proj.weight_grad" for i in range(5)]
    m = np.full((5, 40), 0.2)
    m[:, 0] = 90.0
    p = plot_heatmap(tmp_path / "h.png", "underflow", names, np.arange(1, 41), m)
    q = plot_policy_summary(tmp_path / "p.png", [
        {"policy": "delayed:history=16,algo=max,margin=0", "events": 2,
         "median_underflow_pct": 0.1, "worst_underflow_pct": 3.0},
        {"policy": "current", "events": 0, "median_underflow_pct": 0.0, "worst_underflow_pct": 0.5}])
    for f in (p, q):
        assert open(f, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
