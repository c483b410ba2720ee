"""Feature maps φ for linear attention, and their registry.

>>> from linattn import feature_maps
>>> "elu" in feature_maps.available()
True
>>> phi = feature_maps.create("elu", head_dim=64)
"""

from __future__ import annotations

from .base import CallableFeatureMap, FeatureMap
from .elementwise import EluFeatureMap, IdentityFeatureMap, ReluFeatureMap
from .learned import HedgehogFeatureMap, LearnedProjectionMap, T2RFeatureMap
from .polynomial import DpfpFeatureMap, RebasedFeatureMap, TaylorFeatureMap
from .random import (
    FavorPlusFeatureMap,
    FavorPlusPlusFeatureMap,
    RandomFeatureMap,
    TrigFeatureMap,
    redraw_random_features,
)
from .registry import available, create, register

register("elu", EluFeatureMap)
register("relu", ReluFeatureMap)
register("identity", IdentityFeatureMap)
register("t2r", T2RFeatureMap)
register("hedgehog", HedgehogFeatureMap)
register("favor+", FavorPlusFeatureMap)
register("favor++", FavorPlusPlusFeatureMap)
register("trig", TrigFeatureMap)
register("taylor", TaylorFeatureMap)
register("rebased", RebasedFeatureMap)
register("dpfp", DpfpFeatureMap)

__all__ = [
    "CallableFeatureMap",
    "DpfpFeatureMap",
    "EluFeatureMap",
    "FavorPlusFeatureMap",
    "FavorPlusPlusFeatureMap",
    "FeatureMap",
    "HedgehogFeatureMap",
    "IdentityFeatureMap",
    "LearnedProjectionMap",
    "RandomFeatureMap",
    "RebasedFeatureMap",
    "ReluFeatureMap",
    "T2RFeatureMap",
    "TaylorFeatureMap",
    "TrigFeatureMap",
    "available",
    "create",
    "redraw_random_features",
    "register",
]
