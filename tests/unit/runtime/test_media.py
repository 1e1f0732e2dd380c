"""Video files through the libraries (`diffusers.utils.export_to_gif`, imageio's ffmpeg writer), written atomically:
the frames, the timing and the loop flag read back from the files against values set by hand."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from diffalign.runtime.media import save_video
from diffalign.runtime.trackers import gif_bytes


def _ramp(frames: int = 4, height: int = 6, width: int = 10) -> torch.Tensor:
    """Frame f is solid (f / (F − 1), 0, 1 − f / (F − 1)): red ramps up, blue down."""
    video = torch.zeros(frames, 3, height, width)
    level = torch.linspace(0, 1, frames).view(frames, 1, 1)
    video[:, 0], video[:, 2] = level, 1 - level
    return video


def test_a_gif_holds_every_frame_at_1000_over_fps_ms_and_loops(tmp_path):
    path = save_video(_ramp(), tmp_path / "v.gif", fps=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.gif"]  # no temporary file left beside it
    gif = Image.open(path)
    assert (gif.n_frames, gif.size, gif.info["loop"], gif.info["duration"]) == (4, (10, 6), 0, 100)
    for f, expected in enumerate([(0, 0, 255), (85, 0, 170), (170, 0, 85), (255, 0, 0)]):  # round(255 · f / 3)
        gif.seek(f)
        assert np.array(gif.convert("RGB")).reshape(-1, 3).tolist() == [list(expected)] * 60, f


def test_gif_bytes_turn_an_mp4_into_a_gif_of_its_frames(tmp_path):
    mp4 = save_video(_ramp(height=8), tmp_path / "v.mp4", fps=4)
    (tmp_path / "t.gif").write_bytes(gif_bytes(mp4, fps=4))
    gif = Image.open(tmp_path / "t.gif")
    assert (gif.n_frames, gif.size, gif.info["duration"]) == (4, (10, 8), 250)
    gif.seek(3)
    red, _, blue = np.array(gif.convert("RGB"))[4, 5].tolist()
    assert red > 235 and blue < 20  # the last frame is red (H.264 rounds it a little)
    gif_path = save_video(_ramp(), tmp_path / "w.gif")
    assert gif_bytes(gif_path) == gif_path.read_bytes()  # a GIF file as it is
