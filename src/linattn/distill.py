"""Moved: fitting learned maps is :mod:`linattn.train.distill`; the fitted maps and their file are
:mod:`linattn.feature_maps.fitted`. The names are re-exported here so that code written against
``linattn.distill`` keeps working (with the private helpers that tests and benchmarks import); new code imports
from those modules.
"""

from __future__ import annotations

from .feature_maps.fitted import FORMAT_VERSION, FittedFeatureMaps, check_head_mask, load_feature_maps
from .train.distill import _batch as _batch
from .train.distill import _hybrid_loss as _hybrid_loss
from .train.distill import _loss as _loss
from .train.distill import _prepare as _prepare
from .train.distill import _window_masks as _window_masks
from .train.distill import fit_feature_map, fit_model_feature_maps

__all__ = [
    "FORMAT_VERSION",
    "FittedFeatureMaps",
    "check_head_mask",
    "fit_feature_map",
    "fit_model_feature_maps",
    "load_feature_maps",
]
