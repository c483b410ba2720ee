"""torch.compile(fullgraph=True) of the sliding-window hybrid: no graph break, the same values and gradients as eager.

The graph is captured by Dynamo and run through AOTAutograd (backend "aot_eager"): that is where a data-dependent
branch or an untraceable op breaks a full graph; Inductor's code generation of the same graph takes minutes on a
CPU (docs/window.md, "torch.compile"), too long for the suite.
"""

from __future__ import annotations

import pytest
import torch

from linattn import linear_attention


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True},
        {"causal": False},
        {"causal": True, "padding": True},
        {"causal": False, "padding": True},
        {"causal": True, "window_factor": "per-head"},
    ],
    ids=["causal", "noncausal", "causal-padding", "noncausal-padding", "causal-gamma"],
)
def test_window_compiles_to_one_graph_with_eager_values(options):
    check_against_eager(options, backward=False)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_window_compiles_to_one_graph_with_eager_gradients(causal):
    check_against_eager({"causal": causal}, backward=True)


def check_against_eager(options: dict, backward: bool) -> None:
    # N = 64 > 3 query blocks of 16: the fused exact part has interior tiles (views of this call's keys) and edges
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    keep = None
    if options.get("padding"):
        keep = torch.rand(1, 64) > 0.2
        keep[:, 0] = True
    gamma = torch.tensor([0.7, 1.3]) if options.get("window_factor") else None

    def fn(q, k, v):
        return linear_attention(q, k, v, causal=options["causal"], window=8, sinks=2, key_padding_mask=keep,
                                window_factor=gamma)

    eager_leaves = [x.clone().requires_grad_(backward) for x in (q, k, v)]
    eager = fn(*eager_leaves)
    leaves = [x.clone().requires_grad_(backward) for x in (q, k, v)]
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves)  # raises on any graph break
    # the same ops in the same order (aot_eager runs the traced aten ops): equal up to fp32 rounding
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    if not backward:
        return
    eager.square().sum().backward()
    out.square().sum().backward()
    for leaf, eager_leaf in zip(leaves, eager_leaves, strict=True):
        torch.testing.assert_close(leaf.grad, eager_leaf.grad, rtol=1e-4, atol=1e-6)
