"""The guard that reads nothing back (:func:`linattn._causal._guard_on_device`, the one GPUs get) against the one
that reads a sum back (:func:`linattn._causal._guard_on_host`, the CPU's), run on CPU tensors over every route of
the capability table (the cases of tests/test_causal_bad_values.py), in fp32 and fp64:

- finite inputs: the same output and gradients, bit for bit;
- a NaN or inf key or value at token t: rows before t bit for bit the host guard's, rows from t to the end of its
  sequence NaN, later packed sequences untouched; the rows before t train as without it;
- bad values in masked-out keys: no change at all;
- a final state: NaN in the batch element that read a bad value, the others bit for bit the host guard's;
- no value read back to the host, and the guard chosen by the tensors' device.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from types import SimpleNamespace

import pytest
import torch

import linattn.functional as functional
from linattn import _causal, linear_attention
from test_causal_bad_values import BAD, CASES, IDS, _covered, _inputs, _run, _sequence_end

GUARDS = {"host": _causal._guard_on_host, "device": _causal._guard_on_device}
DTYPES = [torch.float32, torch.float64]


@contextmanager
def _guard(name: str):
    """Causal calls through the named guard, whatever the device."""
    guard = GUARDS[name]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(functional, "run_causally", lambda run, job: guard(run, job) if job.causal else run(job))
        yield


def _both(route, options, q, k, v, grad=None, guards=tuple(GUARDS), **extra):
    """{guard: (output, (dq, dk, dv) or None)} for the same call through each guard."""
    results = {}
    for name in guards:
        inputs = [x.detach().clone().requires_grad_(grad is not None) for x in (q, k, v)]
        with _guard(name):
            out = _run(route, options, *inputs, **extra)
        grads = torch.autograd.grad(out, inputs, grad) if grad is not None else None
        results[name] = (out.detach(), grads)
    return results


def _cast(dtype, *tensors):
    return [x.to(dtype) for x in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("route,name,options", CASES, ids=IDS)
def test_finite_inputs_give_the_same_output_and_gradients(route, name, options, dtype):
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _cast(dtype, *_inputs())
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    results = _both(route, options, q, k, v, grad)
    (host, host_grads), (device, device_grads) = results["host"], results["device"]
    assert bool(torch.isfinite(host).all())
    assert torch.equal(device, host)
    for which, a, b in zip("qkv", device_grads, host_grads, strict=True):
        assert torch.equal(a, b), f"d{which} differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("route,name,options", CASES, ids=IDS)
def test_a_bad_key_or_value_keeps_the_host_guards_earlier_rows(route, name, options, dtype):
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _cast(dtype, *_inputs())
    for which, bad, t in BAD if dtype == torch.float32 else BAD[::2]:  # fp64: NaN and -inf, k and v, three places
        k_bad, v_bad = k.clone(), v.clone()
        (k_bad if which == "k" else v_bad)[..., t, 1] = bad
        results = _both(route, options, q, k_bad, v_bad)
        host, device = results["host"][0], results["device"][0]
        end = _sequence_end(t, options)
        assert torch.equal(device[..., :t, :], host[..., :t, :]), f"{which}[{t}] = {bad}: rows before {t}"
        assert bool(torch.isnan(device[..., t:end, :]).all()), f"{which}[{t}] = {bad}: rows {t}:{end} not NaN"
        assert torch.equal(device[..., end:, :], host[..., end:, :]), f"{which}[{t}] = {bad}: later sequences"


@pytest.mark.parametrize("route,name,options", CASES, ids=IDS)
def test_the_rows_before_a_bad_token_train_as_without_it(route, name, options):
    """A loss on the rows before t: the gradients are bit for bit those of finite inputs (the NaN rows pass none
    back). The host guard's are NaN here: its first run's backward meets the bad value."""
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _inputs()
    t = 21
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    grad[..., t:, :] = 0
    k_bad = k.clone()
    k_bad[..., t, 1] = float("nan")
    clean = _both(route, options, q, k, v, grad, guards=["device"])["device"][1]
    device = _both(route, options, q, k_bad, v, grad, guards=["device"])["device"][1]
    for which, a, b in zip("qkv", device, clean, strict=True):
        assert torch.equal(a, b), f"d{which} differs"


@pytest.mark.parametrize("route,name,options", CASES, ids=IDS)
def test_bad_values_in_padding_change_nothing(route, name, options):
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _inputs(1)
    keep = torch.ones(1, k.shape[-2], dtype=torch.bool)
    keep[:, 9:12] = False
    keep[:, -2:] = False
    clean = _both(route, options, q, k, v, guards=["host"], key_padding_mask=keep)["host"][0]
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[..., 9, :], v_bad[..., 10, :] = float("nan"), float("inf")
    k_bad[..., 11, 0], v_bad[..., 11, 0] = float("-inf"), float("nan")
    k_bad[..., -1, :], v_bad[..., -2, :] = float("inf"), float("nan")
    results = _both(route, options, q, k_bad, v_bad, key_padding_mask=keep)
    assert bool(torch.isfinite(clean).all())
    assert torch.equal(results["device"][0], clean) and torch.equal(results["host"][0], clean)


def _tensors(state, prefix="state"):
    """(name, tensor) for every tensor of a state dataclass, nested ones too."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif is_dataclass(state):
        for field in fields(state):
            yield from _tensors(getattr(state, field.name), f"{prefix}.{field.name}")


STATE_CASES = [(route, name, options) for route, name, options in CASES if "cu_seqlens" not in options]


@pytest.mark.parametrize("route,name,options", STATE_CASES, ids=[f"{r.name}-{name}" for r, name, _ in STATE_CASES])
def test_a_final_state_that_read_a_bad_value_is_nan(route, name, options):
    """Head 0 reads a NaN key: its final state is NaN in every floating tensor (the host guard's in part: the
    linear sums), a sparse cache's apart (its packed list holds every head's); head 1's final state and rows are
    bit for bit the host guard's."""
    if not _covered(route, options):
        pytest.skip(f"{route.name} does not run causal calls")
    q, k, v = _inputs()
    k[0, 0, 20, 1] = float("nan")
    finals = {}
    for guard in GUARDS:
        with _guard(guard):
            finals[guard] = _run(route, options, q, k, v, return_state=True)
    (host, host_state), (device, device_state) = finals["host"], finals["device"]
    assert torch.equal(device[:, 1], host[:, 1])
    batched = [(where, a, b) for (where, a), (_, b) in zip(_tensors(device_state), _tensors(host_state), strict=True)
               if a.is_floating_point() and not where.startswith("state.cache.")]
    assert any(a.numel() for _, a, _ in batched)
    for where, a, b in batched:
        assert bool(torch.isnan(a[:, 0]).all()), f"{where}: head 0 not NaN"
        assert torch.equal(a[:, 1], b[:, 1]), f"{where}: head 1 differs"
    assert not all(bool(torch.isfinite(b[:, 0]).all()) for _, _, b in batched)  # the host guard's, for comparison


@pytest.mark.parametrize("options", [{}, {"window": 2}], ids=["plain", "window"])
def test_a_two_dimensional_call(options):
    """(N, D) inputs: no batch dims, so a bad token makes the whole final state NaN."""
    q, k, v = (x[0, 0] for x in _inputs())
    k[20, 3] = float("inf")
    with _guard("device"):
        out, state = linear_attention(q, k, v, causal=True, return_state=True, **options)
    assert bool(torch.isfinite(out[:20]).all()) and bool(torch.isnan(out[20:]).all())
    floating = [x for _, x in _tensors(state) if x.is_floating_point() and x.numel()]
    assert floating and all(bool(torch.isnan(x).all()) for x in floating)


def _job_of(**options):
    """The Job that ``linear_attention`` hands its guard, and its runner."""
    seen = {}

    def capture(run, job):
        seen.update(run=run, job=job)
        return run(job)

    q, k, v = _inputs()
    k[..., 5, 0], v[..., 30, 2] = float("nan"), float("inf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(functional, "run_causally", capture)
        linear_attention(q, k, v, causal=True, **options)
    return seen["run"], seen["job"]


def _refuse(*_args, **_kwargs):
    raise AssertionError("a value was read back to the host")


@pytest.mark.parametrize("options", [{}, {"cu_seqlens": [0, 13, 37]}, {"key_padding_mask": torch.arange(37) % 7 > 0}],
                         ids=["plain", "packed", "masked"])
def test_the_device_guard_reads_nothing_back(options):
    """Every way a tensor's value reaches Python refused: the device guard still runs (the runner is a stub, the
    forms are not under test), and the host guard does not (so the refusal is seen)."""
    run, job = _job_of(**options)
    out, final = run(job)
    stub = lambda _job: (torch.zeros_like(out), final)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        for method in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy"):
            patch.setattr(torch.Tensor, method, _refuse)
        guarded, _ = _causal._guard_on_device(stub, job)
        with pytest.raises(AssertionError, match="read back"):
            _causal._guard_on_host(stub, job)
    assert bool(torch.isnan(guarded).any()) and bool(torch.isfinite(guarded[..., :5, :]).all())


@pytest.mark.parametrize("device,capturing,chosen", [("cuda", False, "device"), ("cpu", False, "host"),
                                                     ("meta", False, "device"), ("cuda", True, "none")])
def test_the_guard_is_chosen_by_the_device(device, capturing, chosen):
    calls = []
    job = SimpleNamespace(causal=True, k=SimpleNamespace(device=torch.device(device)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        for name in GUARDS:
            patch.setattr(_causal, f"_guard_on_{name}", lambda run, job, name=name: calls.append(name))
        _causal.run_causally(lambda job: calls.append("none"), job)  # type: ignore[arg-type]
    assert calls == [chosen]
