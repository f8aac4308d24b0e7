"""Newton–Schulz orthogonalization: the one piece of math every Muon mode shares.

Pure functions on plain tensors; no Megatron and no process group here.

Given M = U S Vᵀ, the iteration drives the singular values of X = M / ‖M‖_F towards 1 with the
odd quintic  X ← a·X + (b·A + c·A²)·X,  A = X·Xᵀ.  Because the polynomial is odd,
NS(Mᵀ) = NS(M)ᵀ in exact arithmetic, which is why the iteration is free to run on whichever
orientation makes A = X·Xᵀ the smaller Gram matrix (and why the TP modes may pick the other one).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, cycle, islice, repeat

import torch

__all__ = [
    "COEFFICIENT_SETS",
    "DEFAULT_COEFFICIENTS",
    "Coefficients",
    "coefficient_schedule",
    "newton_schulz",
    "ns_flops",
]

Coefficients = str | Sequence[tuple[float, float, float]]

COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    # Keller Jordan's quintic (KellerJordan/Muon, muon.py): tuned to maximise the slope at zero.
    # torch.optim.Muon (torch >= 2.9) uses exactly this set, as DEFAULT_A/B/C.
    "jordan": ((3.4445, -4.7750, 2.0315),),
    # The per-step schedule of modded-nanogpt (leloykun's "muon-opt-coeffs" post), which
    # emerging-optimizers 0.3.0 calls "quintic" and uses by default.
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Polar Express (Amsel et al., arXiv 2505.16932, Algorithm 1), with its 1.01 safety
    # division folded into the coefficients as emerging-optimizers 0.3.0 does.
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    # CANS (Grishina et al., arXiv 2506.10935): Remez polynomials on an adaptive interval.
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    # AOL-preconditioned schedule (thib-s/flash-newton-schulz).
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
}
# Megatron's --muon-coefficient-type calls Keller Jordan's set "simple".
COEFFICIENT_SETS["simple"] = COEFFICIENT_SETS["jordan"]

DEFAULT_COEFFICIENTS = "quintic"
"""The package's one default set: upstream Megatron's ``--muon-coefficient-type`` default and
emerging-optimizers'. ``torch.optim.Muon`` uses ``"jordan"``; ``core.muon.Muon``, which mirrors
torch's signature and defaults, is the one place that keeps torch's choice."""

# Schedules designed as a sequence of shrinking intervals end on their most conservative
# polynomial, so past their length they repeat the last tuple; every other set cycles. This is
# emerging-optimizers 0.3.0's rule (repeat_last for polar_express and cans, cycle otherwise,
# custom lists included).
_REPEAT_LAST = frozenset({"polar_express", "cans"})


def coefficient_schedule(coefficients: Coefficients, steps: int) -> list[tuple[float, float, float]]:
    """Return the (a, b, c) used at each of ``steps`` iterations.

    ``coefficients`` is a set name from ``COEFFICIENT_SETS`` or an explicit sequence of
    (a, b, c) tuples (which cycles, as emerging-optimizers' ``custom`` does).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"newton_schulz: steps must be an integer >= 1, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(
                f"newton_schulz: unknown coefficient set {coefficients!r}; expected one of "
                f"{sorted(COEFFICIENT_SETS)} or a list of (a, b, c) tuples"
            )
        sets = COEFFICIENT_SETS[coefficients]
        repeat_last = coefficients in _REPEAT_LAST
    else:
        sets = tuple(tuple(float(v) for v in t) for t in coefficients)
        if not sets or any(len(t) != 3 for t in sets):
            raise ValueError(
                "newton_schulz: an explicit coefficient list must be a non-empty sequence of "
                f"(a, b, c) tuples, got {coefficients!r}"
            )
        repeat_last = False
    source = chain(sets, repeat(sets[-1])) if repeat_last else cycle(sets)
    return list(islice(source, steps))


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = DEFAULT_COEFFICIENTS,
    *,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U·Vᵀ of each matrix in ``x``.

    Args:
        x: ``(m, n)`` or a stack ``(batch, m, n)`` of same-shape matrices.
        steps: number of quintic iterations (>= 1).
        coefficients: a set name (``"quintic"``, the default; ``"jordan"`` = torch.optim.Muon's,
            ``"polar_express"``, ``"cans"``, ``"aol"``) or a list of (a, b, c) tuples.
        eps: floor on the Frobenius norm, so an all-zero matrix maps to zero.

    Returns:
        A tensor of ``x``'s shape and dtype. All arithmetic runs in ``x``'s dtype: pass bf16 to
        get torch.optim.Muon's numerics (with "jordan" the 2-D path is the same op sequence,
        hence bitwise equal on the same device), fp32 for a reference.

    Invariant: zero rows (or columns) of ``x`` stay zero, so zero-padding a matrix before the call
    and cropping afterwards is exact.
    """
    if not isinstance(x, torch.Tensor) or x.ndim not in (2, 3):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"newton_schulz: expected a 2-D (m, n) or 3-D (batch, m, n) tensor, got shape {shape}"
        )
    if not x.is_floating_point():
        raise ValueError(f"newton_schulz: expected a floating-point tensor, got {x.dtype}")
    schedule = coefficient_schedule(coefficients, steps)

    # Iterate on the orientation whose Gram matrix X·Xᵀ is the smaller one.
    transposed = x.size(-2) > x.size(-1)
    X = x.mT if transposed else x
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    batched = X.ndim == 3
    for a, b, c in schedule:
        A = X @ X.mT
        if batched:
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
        else:
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    return X.mT if transposed else X


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic iterations on a rows × cols matrix.

    With a = min(rows, cols) and b = max: X·Xᵀ costs 2a²b, A·A costs 2a³, B·X costs 2a²b,
    so one iteration is 4a²b + 2a³ (a square n × n matrix: 30n³ for five steps).
    """
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a * a * a)
