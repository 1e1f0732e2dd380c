"""``trainer.cudnn_attention``: false turns cuDNN's scaled-dot-product attention off for the run's process (the switch
that let FLUX.1-dev's LoRA step run on an H200 where cuDNN's attention backward failed, docs/guides/flux.md#memory);
the default leaves PyTorch's choice alone."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from diffalign.train.common import make_accelerator
from diffalign.train.configs import TrainerConfig


@pytest.fixture
def restore_cudnn_sdp():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def _cfg(tmp_path, **trainer):
    return OmegaConf.create({"trainer": OmegaConf.structured(TrainerConfig(cpu=True, log_with="none", **trainer)),
                             "output_dir": str(tmp_path), "seed": 0})


def test_cudnn_attention_false_turns_it_off_for_the_process(tmp_path, restore_cudnn_sdp):
    torch.backends.cuda.enable_cudnn_sdp(True)
    make_accelerator(_cfg(tmp_path, cudnn_attention=False))
    assert torch.backends.cuda.cudnn_sdp_enabled() is False


def test_the_default_leaves_pytorchs_choice_alone(tmp_path, restore_cudnn_sdp):
    assert TrainerConfig().cudnn_attention is True
    torch.backends.cuda.enable_cudnn_sdp(True)
    make_accelerator(_cfg(tmp_path))
    assert torch.backends.cuda.cudnn_sdp_enabled() is True
