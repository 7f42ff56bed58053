"""The release's size buckets: one table (lingbot_core.model.size_presets) for the CLI and the Size Preset node.

Expected values: lingbot-video-model.md section 7.1, (H, W) with the ratio read as H:W.
"""

import pytest

from lingbot_core import cli
from lingbot_core.model.size_presets import BUCKETS, RATIOS, preset_label, preset_labels, size_from_label

DOC = {  # (H, W) per ratio 1:1, 9:16, 16:9, 3:4, 4:3
    "192p": [(192, 192), (192, 320), (320, 192), (192, 256), (256, 192)],
    "480p": [(480, 480), (480, 832), (832, 480), (480, 640), (640, 480)],
    "720p": [(736, 736), (736, 1280), (1280, 736), (736, 960), (960, 736)],
    "1080p": [(1088, 1088), (1088, 1920), (1920, 1088), (1088, 1440), (1440, 1088)],
}


def test_table_is_the_documented_one_and_the_clis():
    assert cli.BUCKETS is BUCKETS
    for resolution, sizes in DOC.items():
        assert [BUCKETS[resolution][r] for r in ("1:1", "9:16", "16:9", "3:4", "4:3")] == sizes
    parser = cli.build_parser()
    gen = next(a for a in parser._subparsers._group_actions[0].choices["generate"]._actions if a.dest == "ratio")
    res = next(a for a in parser._subparsers._group_actions[0].choices["generate"]._actions if a.dest == "resolution")
    assert list(gen.choices) == list(RATIOS) and sorted(res.choices) == sorted(BUCKETS)


def test_node_labels_name_the_size_they_give():
    labels = preset_labels()
    assert len(labels) == len(BUCKETS) * len(RATIOS)
    assert preset_label("480p", "9:16") == "480p 9:16 - 832x480 (landscape)"
    assert preset_label("480p", "16:9") == "480p 16:9 - 480x832 (portrait)"
    assert preset_label("1080p", "1:1") == "1080p 1:1 - 1088x1088 (square)"
    assert all(size_from_label(label) == BUCKETS[label.split()[0]][label.split()[1]] for label in labels)
    for bad in ("480p 9:16 - 999x480 (landscape)", "480p 2:1 - 832x480 (landscape)", "nonsense"):
        with pytest.raises(ValueError, match="preset"):
            size_from_label(bad)
