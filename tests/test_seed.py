"""The seed API against the source document's own functions (the oracle, copied below)."""

from __future__ import annotations

import numpy as np
import pytest

import linattn
from linattn import LinearAttentionError

# --- oracle: copied verbatim from the source document (../shared/seed/000_548318a29dc485e7.txt) -----------------


def seed_stable_linear_attention(Q, K, V, feature_map, eps=1e-6, min_denom=1e-4):
    """Linear attention with enhanced numerical stability."""
    Q_prime = feature_map(Q)
    K_prime = feature_map(K)

    KV = K_prime.T @ V
    K_sum = K_prime.sum(axis=0)

    numerator = Q_prime @ KV
    denominator = Q_prime @ K_sum

    # Clip denominator to prevent extreme values
    denominator = np.maximum(denominator, min_denom)

    return numerator / denominator[:, np.newaxis]


def seed_chunked_linear_attention(Q, K, V, feature_map, chunk_size=512, eps=1e-6):
    """
    Memory-efficient linear attention with chunked accumulation.

    Useful when even the KV aggregate is too large to compute at once.
    """
    n, d_k = Q.shape
    d_v = V.shape[1]

    Q_prime = feature_map(Q)
    K_prime = feature_map(K)

    # Accumulate KV and K_sum in chunks
    KV = np.zeros((d_k, d_v), dtype=Q.dtype)
    K_sum = np.zeros(d_k, dtype=Q.dtype)

    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        KV += K_prime[start:end].T @ V[start:end]
        K_sum += K_prime[start:end].sum(axis=0)

    # Compute outputs
    numerator = Q_prime @ KV
    denominator = Q_prime @ K_sum + eps

    return numerator / denominator[:, np.newaxis]


# --- end of the oracle -----------------------------------------------------------------------------------------


def elu1(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def relu(x):
    return np.maximum(x, 0)


def doubled(x):  # F = 2·d_k: the document's chunked function cannot take it
    return np.concatenate([elu1(x), elu1(-x)], axis=-1)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("n", [1, 100, 1000, 1300])
@pytest.mark.parametrize("feature_map", [elu1, relu, doubled], ids=["elu", "relu", "F=2dk"])
def test_stable_matches_seed(n, feature_map):
    rng = np.random.default_rng(n)
    Q, K, V = rng.standard_normal((n, 16)), rng.standard_normal((n, 16)), rng.standard_normal((n, 8))
    ours = linattn.stable_linear_attention(Q, K, V, feature_map)
    assert isinstance(ours, np.ndarray) and ours.shape == (n, 8) and ours.dtype == np.float64
    assert rel(ours, seed_stable_linear_attention(Q, K, V, feature_map)) <= 1e-5


@pytest.mark.parametrize("n", [1, 100, 1000, 1300])
@pytest.mark.parametrize("chunk_size", [7, 512])
@pytest.mark.parametrize("feature_map", [elu1, relu], ids=["elu", "relu"])
def test_chunked_matches_seed(n, chunk_size, feature_map):
    rng = np.random.default_rng(n + 1)
    Q, K, V = rng.standard_normal((n, 16)), rng.standard_normal((n, 16)), rng.standard_normal((n, 8))
    ours = linattn.chunked_linear_attention(Q, K, V, feature_map, chunk_size=chunk_size)
    assert rel(ours, seed_chunked_linear_attention(Q, K, V, feature_map, chunk_size=chunk_size)) <= 1e-5


def test_chunked_accepts_feature_dim_other_than_dk():
    """The document's chunked code allocates KV as (d_k, d_v) and fails for F ≠ d_k; ours equals the document's
    stable function there (no clip: min_denom below any denominator)."""
    rng = np.random.default_rng(3)
    Q, K, V = rng.standard_normal((300, 16)), rng.standard_normal((300, 16)), rng.standard_normal((300, 8))
    with pytest.raises(ValueError):
        seed_chunked_linear_attention(Q, K, V, doubled, chunk_size=64)
    ours = linattn.chunked_linear_attention(Q, K, V, doubled, chunk_size=64)
    assert ours.shape == (300, 8)
    assert rel(ours, seed_stable_linear_attention(Q, K, V, doubled, min_denom=1e-300)) <= 1e-5


def test_stable_adds_eps_before_the_clip():
    """Documented difference: eps is added (the document declares it but never uses it)."""
    Q = np.ones((1, 2))
    K = -np.ones((3, 2))  # relu features of K are all 0: denominator 0
    K[0] = [1e-3, 0.0]
    V = np.ones((3, 1))
    out = linattn.stable_linear_attention(Q, K, V, relu, eps=1.0, min_denom=1e-4)
    np.testing.assert_allclose(out, [[1e-3 / (1e-3 + 1.0)]])


def test_seed_api_takes_2d_numpy_only():
    import torch

    with pytest.raises(LinearAttentionError, match=r"Q: the seed API takes 2-D NumPy arrays"):
        linattn.stable_linear_attention(np.ones((2, 3, 4)), np.ones((3, 4)), np.ones((3, 4)), relu)
    with pytest.raises(LinearAttentionError, match=r"K: the seed API takes 2-D NumPy arrays"):
        linattn.chunked_linear_attention(np.ones((3, 4)), torch.ones(3, 4), np.ones((3, 4)), relu)
    with pytest.raises(LinearAttentionError, match=r"chunk_size"):
        linattn.chunked_linear_attention(np.ones((3, 4)), np.ones((3, 4)), np.ones((3, 4)), relu, chunk_size=0)


def test_float32_stays_float32():
    rng = np.random.default_rng(4)
    Q, K, V = (rng.standard_normal((50, 8)).astype(np.float32) for _ in range(3))
    assert linattn.chunked_linear_attention(Q, K, V, elu1).dtype == np.float32
    assert linattn.stable_linear_attention(Q, K, V, elu1).dtype == np.float32
