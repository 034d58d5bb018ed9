"""The efficiency scatter names its points where no name covers another name or point (analysis.zoo.point_labels)."""
import numpy as np
import pandas as pd

from analysis import zoo


def _boxes(fig):
    """Every drawn label's box and every marker's, in the plot pixels point_labels reasons in."""
    xr, yr = fig.layout.xaxis.range, fig.layout.yaxis.range
    labels, markers = [], []
    for tr in fig.data:
        px, py = zoo.plot_pixels(np.log10(np.asarray(tr.x, float)), np.asarray(tr.y, float), xr, yr)
        r = zoo.MARKER_PX / 2
        markers += [(i, (x - r, y - r, x + r, y + r)) for i, (x, y) in enumerate(zip(px, py))]
        for box, text in zip(zoo.label_boxes(px, py, list(tr.text), list(tr.textposition)), tr.text):
            if text:
                labels.append((text, box))
    return labels, markers


def test_the_shipped_zoo_scatter_has_no_label_over_another_label_or_point():
    table = zoo.zoo_table(zoo.find_model_dirs(zoo.models_root()))
    fig = zoo.efficiency_figure(table)
    labels, markers = _boxes(fig)
    shown = ", ".join(t for t, _ in labels)
    for name in zoo.zoo_rows(table)[0]["model"]:   # every zoo model is named once
        assert shown.split(", ").count(name) == 1, (name, shown)
    for i, (a, box_a) in enumerate(labels):
        for b, box_b in labels[i + 1:]:
            assert not zoo._overlap(box_a, box_b), (a, b)
        assert sum(zoo._overlap(box_a, m) for _, m in markers) == 0, a


def test_points_on_top_of_each_other_share_one_label_and_apart_points_keep_their_own():
    px, py = np.array([100.0, 103.0, 300.0]), np.array([100.0, 101.0, 100.0])
    text, where = zoo.point_labels(px, py, ["sha", "mhe-add", "mqa"])
    assert text == ["sha, mhe-add", "", "mqa"]
    assert set(where) <= set(zoo.PLACES)


def test_two_close_points_are_labelled_on_different_sides():
    # 20 px apart vertically: both "top center" would cover the upper point's marker with the lower one's name
    px, py = np.array([200.0, 200.0]), np.array([100.0, 120.0])
    text, where = zoo.point_labels(px, py, ["mha-1024-pruned", "mha-1024"])
    boxes = zoo.label_boxes(px, py, text, where)
    assert not zoo._overlap(*boxes)
    r = zoo.MARKER_PX / 2
    for box in boxes:
        assert not any(zoo._overlap(box, (x - r, y - r, x + r, y + r)) for x, y in zip(px, py))


def test_an_empty_table_draws_an_empty_figure():
    empty = pd.DataFrame(columns=["model", "mixer", "attention params", "test ppl", "total params",
                                  "KV-cache bytes/token"])
    assert len(zoo.efficiency_figure(empty).data) == 0
