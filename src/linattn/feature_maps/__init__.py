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
from .registry import available, create, register

register("elu", EluFeatureMap)
register("relu", ReluFeatureMap)
register("identity", IdentityFeatureMap)
register("t2r", T2RFeatureMap)
register("hedgehog", HedgehogFeatureMap)

__all__ = [
    "CallableFeatureMap",
    "EluFeatureMap",
    "FeatureMap",
    "HedgehogFeatureMap",
    "IdentityFeatureMap",
    "LearnedProjectionMap",
    "ReluFeatureMap",
    "T2RFeatureMap",
    "available",
    "create",
    "register",
]
