"""``core.ns_traffic``: the elements a Newton–Schulz call touches outside its GEMMs, counted on
the real call.

A dispatch mode sees every aten op ``newton_schulz`` / ``gram_newton_schulz`` / the distributed
mode's ``quintic_iteration`` issues. Views and plain products (``mm``, ``bmm``) touch nothing
beyond their FLOPs; the accumulating products (``addmm``, ``baddbmm``) copy their ``self`` into
the result before the GEMM (2 per element); every other op reads its tensor inputs and writes
its outputs. The formula must equal that count, up to the per-matrix scalars of the
normalization (a few elements per matrix: the bound below), so a change to the NS code that
adds or removes a pass fails here.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_muon.core.matrix_layout import MatrixLayout
from megatron_muon.core.newton_schulz import NSOptions, gram_newton_schulz, newton_schulz, quintic_iteration
from megatron_muon.core.ns_traffic import pass_bytes, pass_elements, sharded_pass_elements
from megatron_muon.plan.pricing import sub_price

pytestmark = pytest.mark.unit

_FREE = {"view", "as_strided", "_unsafe_view", "expand", "slice", "transpose", "t", "select", "alias", "detach",
         "_reshape_alias", "unsqueeze", "squeeze", "permute", "diagonal", "lift_fresh", "mm", "bmm", "matmul"}
_ACCUMULATING = {"addmm", "baddbmm"}
# The normalization's per-matrix scalar ops (max, min, their maximum, its power of two: masking,
# compare, ones, select; the norm, its reciprocal, clamp, product): 14 ops, each reading and writing
# at most 3 one-element tensors per matrix. What they touch is no pass over the matrix, and the
# formula leaves it out; the count may exceed the formula by at most that.
SCALARS_PER_MATRIX = 14 * 3


class _Traffic(TorchDispatchMode):
    """Elements read plus written by the non-GEMM ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _ACCUMULATING:
            self.elements += 2 * args[0].numel()
        elif name not in _FREE:
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.elements += sum(a.numel() for a in args if isinstance(a, torch.Tensor))
            self.elements += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
        return out


def _counted(fn, *args, **kwargs) -> int:
    with _Traffic() as traffic:
        fn(*args, **kwargs)
    return traffic.elements


BATCH_AND_FILING = 4  # per element, the executors' stack into a batch and the results filed out


@pytest.mark.parametrize("shape", [(448, 256), (256, 448), (64, 512), (300, 40), (128, 128)])
@pytest.mark.parametrize("steps", [1, 5])
def test_standard_call_touches_what_the_formula_says(shape, steps):
    ns = NSOptions(steps=steps, dtype=torch.float32)
    counted = _counted(newton_schulz, torch.randn(*shape), steps)
    expected = pass_elements(ns, *shape) - BATCH_AND_FILING * shape[0] * shape[1]
    assert expected <= counted <= expected + SCALARS_PER_MATRIX


def test_a_batch_touches_each_matrix_alike():
    ns = NSOptions(dtype=torch.float32)
    counted = _counted(newton_schulz, torch.randn(3, 256, 448))
    per_matrix = pass_elements(ns, 256, 448) - BATCH_AND_FILING * 256 * 448
    assert 3 * per_matrix <= counted <= 3 * (per_matrix + SCALARS_PER_MATRIX)


@pytest.mark.parametrize("shape", [(64, 512), (512, 48)])
def test_gram_call_touches_what_the_formula_says(shape):
    ns = NSOptions(method="gram", dtype=torch.float32)
    counted = _counted(gram_newton_schulz, torch.randn(*shape), ns.steps, restarts=ns.restarts)
    expected = pass_elements(ns, *shape) - BATCH_AND_FILING * shape[0] * shape[1]
    assert expected <= counted <= expected + SCALARS_PER_MATRIX


@pytest.mark.parametrize("k, cols", [(256, 64), (64, 256)])  # reassociated A·(A·X), and (bA + cA²)·X
def test_distributed_product_form_per_step(k, cols):
    """One step of the distributed mode's product on a k × cols shard (``quintic_iteration``: B's
    rows not split, as on one rank), beside the normalization (per call); a bf16 NS adds the
    Gram's casts to and from its fp32 sum (4k², run by the executor, not here)."""
    ns = NSOptions(steps=1, dtype=torch.float32)
    X, A = torch.randn(k, cols), torch.randn(k, k)
    counted = _counted(quintic_iteration, X, A, 3.4, -4.7, 2.0)
    assert counted == sharded_pass_elements(ns, k, cols, ranks=1) - 13 * k * cols
    bf16 = NSOptions(steps=1, dtype=torch.bfloat16)
    assert sharded_pass_elements(bf16, k, cols, ranks=1) - sharded_pass_elements(ns, k, cols, ranks=1) == 4 * k * k


def test_the_price_carries_the_bytes_and_the_seconds_count_them():
    """``sub_price`` charges a rank the NS traffic of what it runs (owner: the whole matrix on the
    owner, nothing on the others), and ``pricing.seconds`` adds it at the memory bandwidth."""
    from megatron_muon.plan.hardware import CPU_GLOO
    from megatron_muon.plan.pricing import Link, seconds

    ns = NSOptions(dtype=torch.bfloat16)
    sub = MatrixLayout.from_full_shape("w", (1024, 512), partition_dim=0, tp_size=2)
    owner = sub_price(sub, "owner", ns, tp=2, rank=0, owner=0)
    other = sub_price(sub, "owner", ns, tp=2, rank=1, owner=0)
    assert owner.ns_bytes == pass_bytes(ns, 1024, 512) == 2 * pass_elements(ns, 1024, 512)
    assert other.ns_bytes == 0
    link = Link(2, False)
    with_traffic = seconds(owner, CPU_GLOO, link, batches=1, steps=ns.steps)
    without = seconds(type(owner)(**{**owner.__dict__, "ns_bytes": 0.0}), CPU_GLOO, link, batches=1, steps=ns.steps)
    assert with_traffic - without == pytest.approx(owner.ns_bytes / CPU_GLOO.memory_bandwidth)
