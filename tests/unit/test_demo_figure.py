"""The demo figure's restore legend never covers a bar or its value, whichever bar is tallest
(it was drawn over the DCP bar's label in a run where DCP restored slowest)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from cossd.harness import demo_report  # noqa: E402

REPORT = Path(__file__).resolve().parents[2] / "docs/images/demo-report.json"


def with_restores(report: dict[str, Any], seconds: dict[str, float]) -> dict[str, Any]:
    """The saved report with other restore times (cossd's split kept in proportion)."""
    changed = copy.deepcopy(report)
    for method in changed["methods"]:
        if method["key"] in seconds:
            old, new = method["restore_s"], seconds[method["key"]]
            method["restore_s"] = new
            if "params_s" in method["restore_detail"]:
                detail = method["restore_detail"]
                detail["params_s"] *= new / old
                detail["mount_s"] *= new / old
    return changed


@pytest.mark.parametrize("seconds", [
    {},  # the saved run: cossd's bar the tallest
    {"dcp_async": 0.40},  # DCP just under cossd
    {"dcp_async": 1.2},  # DCP the tallest, as in the run that showed the overlap
    {"torch_save": 0.9, "dcp_async": 0.95},
])
def test_the_restore_legend_covers_no_bar_and_no_value(seconds: dict[str, float]) -> None:
    import matplotlib.pyplot as plt

    fig = demo_report.draw(with_restores(json.loads(REPORT.read_text()), seconds))
    try:
        restore = fig.axes[3]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend = restore.get_legend().get_window_extent(renderer)
        labels = [text for text in restore.texts if text.get_text().endswith(" s")]
        assert len(labels) == 3
        for text in labels:
            assert not legend.overlaps(text.get_window_extent(renderer)), text.get_text()
        for bar in restore.patches:
            assert not legend.overlaps(bar.get_window_extent(renderer))
        # Everything stays inside the panel.
        assert restore.get_window_extent(renderer).contains(legend.x0, legend.y0)
        assert restore.get_window_extent(renderer).contains(legend.x1, legend.y1)
    finally:
        plt.close(fig)
