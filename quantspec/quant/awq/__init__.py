"""AWQ: activation-aware weight quantization (Lin et al. 2023, arXiv 2306.00978).

``search.py`` the scale search, ``objective.py`` what it scores candidates on, ``clip.py`` the
clipping search and fake quantization, ``model_check.py`` the model-level clip check,
``scales_file.py`` saved scales, ``method.py`` the calibration-engine method. Why the defaults
are what they are: docs/decisions/awq-defaults.md.
"""

from .clip import (CLIP_AUTO_MAX_BITS, CLIP_SKIP, apply_clip, awq_quantize, clip_error_curve, clip_wanted,
                   fake_quantize, pick_clip, search_clip)
from .method import AWQMethod, AWQProbe, AWQSettings, method_from_recipe, smoother_from_recipe
from .model_check import mean_kl
from .objective import PART_TOKENS, PairObjective, block_errors, capture_parents, keep_helpful_clips
from .search import scale_from_alpha, search_scale, weight_group_mean

__all__ = [
    "AWQMethod", "AWQProbe", "AWQSettings", "CLIP_AUTO_MAX_BITS", "CLIP_SKIP", "PART_TOKENS", "PairObjective",
    "apply_clip", "awq_quantize", "block_errors", "capture_parents", "clip_error_curve", "clip_wanted",
    "fake_quantize", "keep_helpful_clips", "mean_kl", "method_from_recipe", "pick_clip", "scale_from_alpha",
    "search_clip", "search_scale", "smoother_from_recipe", "weight_group_mean",
]
