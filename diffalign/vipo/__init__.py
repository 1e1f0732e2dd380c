"""ViPO (Ni et al., *Visual Preference Policy Optimization*, CVPR 2026, arXiv:2511.18719): the Perceptual Structuring
Module that turns decoded samples into advantage-allocation maps (`diffalign.vipo.psm`) and the frozen vision backbones
it reads (`diffalign.vipo.backbones`). The objective is `diffalign.objectives.vipo.ViPO`."""

from diffalign.vipo.backbones import Dinov2Backbone, TinyClipBackbone, VisionBackbone, build_backbone
from diffalign.vipo.psm import PerceptualStructuring, advantage_maps

__all__ = ["Dinov2Backbone", "PerceptualStructuring", "TinyClipBackbone", "VisionBackbone", "advantage_maps",
           "build_backbone"]
