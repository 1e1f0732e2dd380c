"""Deprecated module, kept for one release: the two video families now have a file each,
`diffalign.models.text_to_video` (`TextToVideoPolicy`, UNet3D) and `diffalign.models.wan` (`WanPolicy`). Importing
their names from here still works (with a `FutureWarning`), so saved configs with
``_target_: diffalign.models.video.TextToVideoPolicy.from_pretrained`` load."""

from __future__ import annotations

import importlib
import warnings

_MOVED = {
    "TextToVideoPolicy": "diffalign.models.text_to_video",
    "TextToVideoPolicyConfig": "diffalign.models.text_to_video",
    "WanPolicy": "diffalign.models.wan",
    "DEFAULT_WAN_LORA_TARGET_MODULES": "diffalign.models.wan",
}


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(f"diffalign.models.video.{name} is deprecated; import it from {_MOVED[name]} (model configs: "
                      f"_target_: {_MOVED[name]}.{name}...)", FutureWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
