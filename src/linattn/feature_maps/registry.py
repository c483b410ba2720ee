"""Feature maps by name: ``available()``, ``create(name, head_dim=..., **options)``, ``register(name, factory)``."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import LinearAttentionError
from .base import FeatureMap

FeatureMapFactory = Callable[..., FeatureMap]

_FACTORIES: dict[str, FeatureMapFactory] = {}


def register(name: str, factory: FeatureMapFactory, *, overwrite: bool = False) -> None:
    """Register ``factory(head_dim=..., **options) -> FeatureMap`` under ``name``."""
    if not isinstance(name, str) or not name:
        raise LinearAttentionError(f"register: name must be a non-empty string, got {name!r}")
    if name in _FACTORIES and not overwrite:
        raise LinearAttentionError(
            f"register: a feature map named {name!r} exists already; pass overwrite=True to replace it"
        )
    _FACTORIES[name] = factory


def available() -> list[str]:
    """Names of the registered feature maps, sorted."""
    return sorted(_FACTORIES)


def create(name: str, head_dim: int | None = None, **options: object) -> FeatureMap:
    """A new feature map ``name`` for inputs of last dimension ``head_dim``, with keyword ``options``."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise LinearAttentionError(
            f"feature_map: unknown name {name!r}; known maps are {', '.join(available())}. "
            "Pass one of these, an nn.Module feature map, or a callable"
        ) from None
    try:
        return factory(head_dim=head_dim, **options)
    except TypeError as error:
        raise LinearAttentionError(f"feature map {name!r}: bad options {options}: {error}") from error
