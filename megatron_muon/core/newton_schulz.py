"""Newton–Schulz orthogonalization: the one piece of math every Muon mode shares.

Pure functions on plain tensors; no Megatron and no process group here.

Given M = U S Vᵀ, the iteration drives the singular values of X = M / ‖M‖_F towards 1 with the
odd quintic  X ← a·X + (b·A + c·A²)·X,  A = X·Xᵀ.  Because the polynomial is odd,
NS(Mᵀ) = NS(M)ᵀ in exact arithmetic, which is why the iteration is free to run on whichever
orientation makes A = X·Xᵀ the smaller Gram matrix (and why the TP modes may pick the other one).

Gram Newton–Schulz (``method="gram"``; Dao AI Lab, "Gram Newton-Schulz", 2026; DeepSpeed #7953)
is the same iteration, rewritten. Every step multiplies X on the left by M = a·I + b·R + c·R², a
polynomial in R = X·Xᵀ, so after k steps X_k = Q_k·X_0 with Q_k = M_k···M_1, and every M, Q and
R is a polynomial in R_0: they commute, and R_{k+1} = M·R_k·M. So the loop runs on a × a matrices
(a the short side): R², M·R·M and M·Q, 8a³ a step, and touches the a × b X only to form R_0 and
to apply Q at the end (4a²b), instead of 4a²b + 2a³ every step. In exact arithmetic the result
is the standard iteration's; in floating point Q drifts from a polynomial of R (its products
round differently), which half precision makes visible (spurious negative eigenvalues of R), so
the iteration *restarts* at the given steps: X ← Q·X, R ← X·Xᵀ, Q ← I (published: once, before
step 3). Below ``GRAM_MIN_ASPECT`` (b/a) the standard iteration is cheaper and runs instead.
``gram_dtype`` may run the Gram path's products in another half precision than X's: fp16 (as
DeepSpeed does) rounds 8× finer than bf16, and after normalization every entry of R, M, Q and X
is O(1) (‖X‖_F = 1 bounds |R_ij| by 1; Q's eigenvalues are the polynomial's gains, below
3.5^steps), far inside fp16's range.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, cycle, islice, repeat

import torch

__all__ = [
    "FP32_PRECISIONS",
    "GRAM_CHUNKS",
    "GRAM_CHUNK_ROWS",
    "NSOptions",
    "COEFFICIENT_SETS",
    "DEFAULT_COEFFICIENTS",
    "Coefficients",
    "coefficient_schedule",
    "GRAM_MIN_ASPECT",
    "HALF_DTYPES",
    "NS_METHODS",
    "gram_block_rows",
    "gram_blocks",
    "gram_chunk_bounds",
    "gram_chunks",
    "gram_iteration",
    "gram_newton_schulz",
    "gram_ns_flops",
    "method_flops",
    "max_abs",
    "newton_schulz",
    "ns_flops",
    "power_of_two_floor",
    "quintic_block",
    "quintic_iteration",
    "reassociates",
    "sharded_gram_flops",
    "sharded_ns_flops",
    "sharded_runs_gram",
    "splits_gram",
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
    # DeepSeek-V4 technical report (deepseek-ai/DeepSeek-V4-Pro, DeepSeek_V4.pdf): eight steps of
    # Keller Jordan's quintic to grow small singular values fast, then two of (2, -1.5, 0.5), which
    # converges to exactly 1 (p(1) = 1, p'(1) = 0). Meant for 10 steps; emerging-optimizers 0.3.0
    # calls it "deepseekv4".
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
}
# Megatron's --muon-coefficient-type calls Keller Jordan's set "simple".
COEFFICIENT_SETS["simple"] = COEFFICIENT_SETS["jordan"]

DEFAULT_COEFFICIENTS = "quintic"
"""The package's one default set: upstream Megatron's ``--muon-coefficient-type`` default and
emerging-optimizers'. ``torch.optim.Muon`` uses ``"jordan"``; ``core.muon.Muon``, which mirrors
torch's signature and defaults, is the one place that keeps torch's choice."""

# Schedules designed as a sequence of shrinking intervals end on their most conservative
# polynomial, so past their length they repeat the last tuple; every other set cycles. This is
# emerging-optimizers 0.3.0's rule (repeat_last for polar_express, cans and deepseekv4, cycle
# otherwise, custom lists included).
_REPEAT_LAST = frozenset({"polar_express", "cans", "deepseekv4"})


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


FP32_PRECISIONS = ("medium", "high", "highest")
"""torch's float32 matmul precisions (``torch.set_float32_matmul_precision``): on GPUs high is
TF32, medium bf16 inside the fp32 GEMM, highest IEEE fp32."""
NS_METHODS = ("standard", "gram")
"""``--muon-ns-method``'s choices: the quintic on X, or Gram Newton–Schulz (module docstring)."""
HALF_DTYPES = (torch.bfloat16, torch.float16)
"""the half precisions NS computes in (``NSOptions.gram_dtype`` picks between them)."""
DEFAULT_GRAM_RESTARTS = (2,)
"""steps before which Gram Newton–Schulz restarts: once, before the third (DeepSpeed's)."""
GRAM_MIN_ASPECT = 1.75
"""b/a (long side over short side) from which ``gram`` runs the Gram iteration; below it, the
standard one. By FLOPs five steps cost 20r + 10 (standard) against 8r + 28 (Gram, one restart)
a³ at aspect r, equal at r = 1.5; measured (fp32, short side 256, this package's CPU machine:
``python -m scripts.bench.bench_ns_methods``, docs/performance.md §11) Gram takes 1.07× the
standard time at 1.5 and 0.94× at 1.75 (the a × a products run a little slower per FLOP here)."""


def _check_matrix(x, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim not in (2, 3):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: expected a 2-D (m, n) or 3-D (batch, m, n) tensor, got shape {shape}")
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected a floating-point tensor, got {x.dtype}")


def _normalized(X: torch.Tensor, eps: float) -> torch.Tensor:
    """X / max(‖X‖_F, eps) per matrix, overflow-safe (see ``newton_schulz``)."""
    if not X.numel():
        return X
    scale = power_of_two_floor(max_abs(X))
    X = X / scale
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps / scale)
    # In place into the fresh X/scale (one matrix-sized allocation, as before the scaling:
    # a second one costs ~10x the arithmetic on CPU in page faults); out of place only
    # when autograd needs X/scale for the norm's backward.
    return X / norm if X.requires_grad else X.div_(norm)


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = DEFAULT_COEFFICIENTS,
    *,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U·Vᵀ of each matrix in ``x``.

    Args:
        x: ``(m, n)`` or a stack ``(batch, m, n)`` of same-shape matrices; a zero dim gives an
            empty result (nothing to orthogonalize).
        steps: number of quintic iterations (>= 1).
        coefficients: a name from ``COEFFICIENT_SETS`` (``"quintic"``, the default; ``"jordan"``
            = ``"simple"`` = torch.optim.Muon's; ``"polar_express"``, ``"cans"``, ``"aol"``,
            ``"deepseekv4"``) or a list of (a, b, c) tuples.
        eps: floor on the Frobenius norm, so an all-zero matrix maps to zero.

    Normalization first divides each matrix by the power of two just below its largest entry
    (``power_of_two_floor``): ‖X‖_F of entries past ~1e19 overflows fp32 and bf16 (the squares
    pass 3.4e38), and X / inf would be a silent all-zero update. The division by a power of two
    is exact, and ‖X/p‖ = ‖X‖/p, eps/p are exact too, so wherever the plain X / max(‖X‖, eps)
    did not overflow the result is bitwise the same. Cost: a max-abs reduction and one exact
    scaling pass per matrix, no host sync (+0.4 ms on a 1024 × 1024 fp32 matrix on one CPU core,
    where five NS steps take ~500 ms).

    Returns:
        A tensor of ``x``'s shape and dtype. All arithmetic runs in ``x``'s dtype: pass bf16 to
        get torch.optim.Muon's numerics (with "jordan" the 2-D path is the same op sequence,
        hence bitwise equal on the same device), fp32 for a reference.

    Invariant: zero rows (or columns) of ``x`` stay zero, so zero-padding a matrix before the call
    and cropping afterwards is exact.
    """
    _check_matrix(x, "newton_schulz")
    schedule = coefficient_schedule(coefficients, steps)

    # Iterate on the orientation whose Gram matrix X·Xᵀ is the smaller one.
    transposed = x.size(-2) > x.size(-1)
    X = _normalized(x.mT if transposed else x, eps)  # an empty matrix stays empty
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


def gram_newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients = DEFAULT_COEFFICIENTS,
    *,
    eps: float = 1e-7,
    restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS,
    gram_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``newton_schulz`` by the Gram iteration (module docstring): the same polynomial, run on
    the short side's a × a Gram matrix, restarting before each step in ``restarts`` (0 < step <
    ``steps``; others are ignored). Same arguments, shapes, dtype rule and zero-row invariant as
    ``newton_schulz``, whatever the aspect (the fallback to the standard iteration is
    ``NSOptions``'s, by ``GRAM_MIN_ASPECT``). ``gram_dtype`` (None: ``x``'s): the dtype of every
    product after normalization (R, the a × a iteration, Q·X); the result is cast back to
    ``x``'s dtype."""
    _check_matrix(x, "gram_newton_schulz")
    schedule = coefficient_schedule(coefficients, steps)
    transposed = x.size(-2) > x.size(-1)
    X = _normalized(x.mT if transposed else x, eps).to(gram_dtype or x.dtype)  # O(1) entries from here
    for block in gram_blocks(schedule, restarts):
        Q = gram_iteration(X @ X.mT, block)
        X = Q @ X
    X = X.to(x.dtype)
    return X.mT if transposed else X


def gram_blocks(schedule, restarts: Sequence[int]) -> list[list[tuple[float, float, float]]]:
    """The schedule cut before each restart step (steps outside 1 … len − 1 ignored)."""
    cuts = sorted({r for r in restarts if 0 < r < len(schedule)})
    bounds = [0, *cuts, len(schedule)]
    return [schedule[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def gram_iteration(R: torch.Tensor, block: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """Q = M_k···M_1 for the steps of ``block`` from the Gram ``R`` = X·Xᵀ (``(a, a)`` or a stack):
    one Gram Newton–Schulz block, after which the iterate is ``Q @ X``. R, M and Q are
    symmetric polynomials of R and commute; R is carried as M·R·M (not M²·R) so that rounding
    keeps it symmetric. The R of a block's last step is never formed (a restart or the end
    recomputes it from X). Returns a new tensor of ``R``'s shape and dtype."""
    batched = R.ndim == 3
    addmm = torch.baddbmm if batched else torch.addmm
    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
    Q = None
    for i, (a, b, c) in enumerate(block):
        M = addmm(R, R, R, beta=b, alpha=c).add_(eye, alpha=a)  # a·I + b·R + c·R²
        Q = M if Q is None else M @ Q
        if i + 1 < len(block):
            R = M @ R @ M
    return Q


def gram_ns_flops(rows: int, cols: int, steps: int = 5, restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> int:
    """FLOPs of ``gram_newton_schulz`` on a rows × cols matrix (a = short side, b = long side):
    per block of j steps, R = X·Xᵀ and Q·X (4a²b), R² every step (2a³), M·Q after the first
    (2a³), M·R·M before the last (4a³)."""
    a, b = min(rows, cols), max(rows, cols)
    total = 0
    for block in gram_blocks([None] * steps, restarts):
        j = len(block)
        total += 4 * a * a * b + 2 * a ** 3 * j + 2 * a ** 3 * (j - 1) + 4 * a ** 3 * (j - 1)
    return total


def runs_gram(method: str, rows: int, cols: int) -> bool:
    """Whether ``method`` runs the Gram iteration on a rows × cols matrix (``GRAM_MIN_ASPECT``)."""
    return method == "gram" and max(rows, cols) >= GRAM_MIN_ASPECT * min(rows, cols)


def method_flops(method: str, rows: int, cols: int, steps: int = 5,
                 restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> int:
    """FLOPs of one rows × cols matrix by ``method`` (the Gram one only where it runs)."""
    if runs_gram(method, rows, cols):
        return gram_ns_flops(rows, cols, steps, restarts)
    return ns_flops(rows, cols, steps)


def sharded_runs_gram(method: str, k: int, cols: int, ranks: int) -> bool:
    """Whether the distributed mode runs Gram Newton–Schulz on ``ranks`` column shards ``k × cols``
    (the Gram spans k): where ``method`` is ``gram`` and k is the whole matrix's short side by at
    least ``GRAM_MIN_ASPECT``. Then the Gram is all-reduced once per block (``gram_blocks``), not
    once per step, and every rank runs the a × a iteration whole: fewer collectives, more FLOPs."""
    return runs_gram(method, k, cols * ranks) and k <= cols * ranks


def sharded_gram_flops(k: int, cols: int, steps: int = 5, restarts: Sequence[int] = DEFAULT_GRAM_RESTARTS) -> int:
    """Per-rank FLOPs of the distributed Gram iteration on a ``k × cols`` column shard: per block of
    j steps its share of R (2k²·cols) and of Q·X (2k²·cols), and the k × k iteration whole."""
    total = 0
    for block in gram_blocks([None] * steps, restarts):
        j = len(block)
        total += 4 * k * k * cols + (2 * j + 2 * (j - 1) + 4 * (j - 1)) * k ** 3
    return total


# Exponent bits of each float format: masking the mantissa (and sign) off a non-negative value
# leaves the largest power of two not above it, exactly, with no log2/exp2 rounding.
_EXPONENT_BITS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def max_abs(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last two dims, keepdim: NaN if any entry is NaN.

    max(amax, −amin) rather than ``vector_norm(x, inf)`` or ``x.abs().amax()``: on CPU the inf
    norm is not vectorized (7 ms on a 1024² fp32 matrix against 0.2 ms here) and ``abs()``
    writes a matrix-sized temporary.
    """
    return torch.maximum(x.amax(dim=(-2, -1), keepdim=True), x.amin(dim=(-2, -1), keepdim=True).neg())


def power_of_two_floor(amax: torch.Tensor) -> torch.Tensor:
    """Elementwise the largest power of two <= ``amax`` (a tensor of non-negative maxima).

    1 where ``amax`` is zero or subnormal (dividing by it is then a no-op, so an all-zero matrix
    stays zero and a subnormal one keeps the eps floor's old behaviour); inf where ``amax`` is
    inf or NaN (a non-finite gradient stays non-finite, never a silent zero). Same dtype and
    device as ``amax``. Dividing by the result is exact (a power of two), which is why
    normalization uses it rather than ``amax`` itself.
    """
    int_dtype, mask = _EXPONENT_BITS.get(amax.dtype, (None, None))
    if int_dtype is None:  # another float format: through fp32, which holds every power of two it can
        return power_of_two_floor(amax.float()).to(amax.dtype)
    p = (amax.contiguous().view(int_dtype) & mask).view(amax.dtype)
    return torch.where(p > 0, p, torch.ones_like(p))


def reassociates(k: int, cols: int) -> bool:
    """Whether one quintic step on a ``k × cols`` X (Gram A = X·Xᵀ is ``k × k``) is cheaper as
    ``a·X + b·(A·X) + c·(A·(A·X))`` than as ``a·X + (b·A + c·A²)·X``.

    The first costs two ``k × k`` by ``k × cols`` products (4k²·cols), the second forms A² (2k³)
    and one product (2k²·cols): reassociating wins exactly when cols < k. On a whole matrix the
    Gram side is the short one (cols >= k), so only a column shard of it (distributed mode:
    k the unsharded dim, cols this rank's share) reassociates.
    """
    return cols < k


def quintic_iteration(X: torch.Tensor, A: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """One odd quintic step ``a·X + (b·A + c·A²)·X`` given the Gram ``A = X·Xᵀ``.

    ``X``: ``(k, cols)`` or a stack ``(batch, k, cols)``; ``A``: ``(k, k)`` or ``(batch, k, k)``,
    the *whole* matrix's Gram (in distributed mode, summed over the TP group). Returns a new
    tensor of ``X``'s shape. The products are associated by ``reassociates``: the same
    polynomial, different rounding (the tests compare both orders against float64).
    """
    batched = X.ndim == 3
    addmm = torch.baddbmm if batched else torch.addmm
    if reassociates(X.shape[-2], X.shape[-1]):
        AX = A @ X
        return addmm(AX, A, AX, beta=b, alpha=c).add_(X, alpha=a)  # b·AX + c·A(AX) + a·X
    B = addmm(A, A, A, beta=b, alpha=c)
    return addmm(X, B, X, beta=a)


def quintic_block(A: torch.Tensor, start: int, stop: int, b: float, c: float) -> torch.Tensor:
    """Rows ``[start, stop)`` of the quintic's B = b·A + c·A² from the whole Gram ``A``
    (``(k, k)`` or a stack ``(batch, k, k)``): b·A[rows] + c·A[rows]·A, 2k²·(stop − start) FLOPs.
    ``A`` is symmetric, so the rows of A² are A's rows times A."""
    rows = A[..., start:stop, :]
    return (torch.baddbmm if A.ndim == 3 else torch.addmm)(rows, rows, A, beta=b, alpha=c)


def gram_block_rows(k: int, ranks: int) -> int:
    """Rows of the ``k × k`` polynomial B = b·A + c·A² that each of ``ranks`` ranks computes when
    they split it (the last block may be short): ceil(k / ranks)."""
    return -(-k // ranks)


def splits_gram(k: int, cols: int, ranks: int) -> bool:
    """Whether ``ranks`` ranks, each holding a ``k × cols`` column shard, should split B's rows.

    Each then forms a ``gram_block_rows`` × k block of B (2k²·ceil(k/ranks) FLOPs instead of
    2k³) and the blocks are all-gathered, so every rank applies the whole B to its shard
    (2k²·cols): cheaper than the reassociated A·(A·X) (4k²·cols) exactly when
    ceil(k/ranks) < cols, i.e. when the shards together are wider than k (Llama-3 405B fc1 at
    TP8: 2048 < 6656). The rule is on shapes only, so every rank decides alike.
    """
    return ranks > 1 and gram_block_rows(k, ranks) < cols


GRAM_CHUNK_ROWS = 2048
"""Fewest rows of a Gram chunk (``gram_chunks``): 2048 × k fp32 is at least 64 MiB at the k
where chunks start, so each chunk's all-reduce is bandwidth-bound, not latency-bound."""
GRAM_CHUNKS = 4
"""Chunks of a large sharded Gram (``gram_chunks``): all but one all-reduce hide under a GEMM."""


def gram_chunks(k: int, ranks: int) -> int:
    """Row chunks in which ``ranks`` ranks form and all-reduce a sharded ``k × k`` Gram: each
    chunk's all-reduce runs while the next chunk's X·Xᵀ rows are computed, so only the first
    chunk's GEMM and the last chunk's all-reduce are not overlapped. ``GRAM_CHUNKS`` where every
    chunk keeps ``GRAM_CHUNK_ROWS`` rows (k ≥ 8192: Llama-3 70B and 405B), else one. The rule is
    on shapes only, so every rank issues the same collectives."""
    return GRAM_CHUNKS if ranks > 1 and k >= GRAM_CHUNKS * GRAM_CHUNK_ROWS else 1


def gram_chunk_bounds(k: int, chunks: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` rows of each of ``chunks`` chunks of a ``k``-row Gram, as even as can be."""
    return [(k * i // chunks, k * (i + 1) // chunks) for i in range(chunks)]


def sharded_ns_flops(k: int, cols: int, steps: int = 5, ranks: int = 1) -> int:
    """Per-rank FLOPs of ``steps`` quintic iterations on a ``k × cols`` column shard whose Gram
    (``k × k``) spans the whole matrix, over ``ranks`` ranks: X·Xᵀ 2k²·cols, then the cheapest
    product form — B's rows split over the ranks (``splits_gram``: 2k²·ceil(k/ranks) + 2k²·cols),
    else ``quintic_iteration``'s min(2k³ + 2k²·cols, 4k²·cols).
    """
    if splits_gram(k, cols, ranks):
        return steps * (4 * k * k * cols + 2 * k * k * gram_block_rows(k, ranks))
    return steps * (2 * k * k * cols + min(2 * k ** 3 + 2 * k * k * cols, 4 * k * k * cols))


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic iterations on a rows × cols matrix.

    With a = min(rows, cols) and b = max: X·Xᵀ costs 2a²b, A·A costs 2a³, B·X costs 2a²b,
    so one iteration is 4a²b + 2a³ (a square n × n matrix: 30n³ for five steps).
    """
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a * a * a)


@dataclass(frozen=True)
class NSOptions:
    """How one Newton–Schulz call runs: the settings every layer passes as one value.

    ``dtype`` is the compute dtype and, in the distributed step, the dtype of the exchanged
    pieces (bf16 halves the bytes; NS would cast to it anyway). Hashable and compared by value:
    a plan records the options it was made for. A later algorithm adds its settings here.
    """

    steps: int = 5
    """iterations (>= 1)."""
    coefficients: Coefficients = DEFAULT_COEFFICIENTS
    """a set name from ``COEFFICIENT_SETS`` or (a, b, c) tuples (kept as a tuple of tuples)."""
    eps: float = 1e-7
    """floor on the Frobenius norm."""
    dtype: torch.dtype = torch.bfloat16
    """compute (and exchange) dtype."""
    method: str = "standard"
    """one of ``NS_METHODS``: the quintic on X, or Gram Newton–Schulz where the aspect makes it
    cheaper (``runs_gram``)."""
    restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS
    """Gram Newton–Schulz's restart steps (``gram_newton_schulz``)."""
    fp32_precision: str = "highest"
    """torch's float32 matmul precision *inside* each Newton–Schulz call (``matmul_precision``):
    what an fp32 NS runs its GEMMs in, whatever the process has set around it."""
    gram_dtype: torch.dtype | None = None
    """the Gram iteration's product dtype (``gram_newton_schulz``); None = ``dtype``. Only with
    ``method="gram"`` and a half-precision ``dtype`` (fp16 in place of bf16): anything else would
    be ignored or lose precision silently, so it is refused."""

    def __post_init__(self) -> None:
        coefficient_schedule(self.coefficients, self.steps)  # one-line ValueError on bad steps / sets
        if not isinstance(self.coefficients, str):
            object.__setattr__(self, "coefficients", tuple(tuple(float(v) for v in t) for t in self.coefficients))
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"newton_schulz: dtype must be a floating-point torch.dtype, got {self.dtype!r}")
        if self.method not in NS_METHODS:
            raise ValueError(f"--muon-ns-method: expected one of {NS_METHODS}, got {self.method!r}")
        if self.fp32_precision not in FP32_PRECISIONS:
            raise ValueError(f"--muon-fp32-matmul-prec: expected one of {FP32_PRECISIONS}, got {self.fp32_precision!r}")
        object.__setattr__(self, "restarts", tuple(int(r) for r in self.restarts))
        if self.gram_dtype is not None and not (
                self.method == "gram" and self.dtype.itemsize == 2 and self.gram_dtype in HALF_DTYPES):
            raise ValueError("--muon-gram-fp16: expected with --muon-ns-method gram and --muon-fp32-matmul-prec "
                             f"medium (a half-precision NS), got method {self.method!r}, NS dtype {self.dtype}, "
                             f"Gram dtype {self.gram_dtype}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Newton–Schulz of ``x`` (a matrix or a stack) with these settings, in ``x``'s dtype."""
        with self.matmul_precision():
            if runs_gram(self.method, x.shape[-2], x.shape[-1]):
                return gram_newton_schulz(x, self.steps, self.coefficients, eps=self.eps, restarts=self.restarts,
                                          gram_dtype=self.gram_dtype)
            return newton_schulz(x, self.steps, self.coefficients, eps=self.eps)

    @contextlib.contextmanager
    def matmul_precision(self) -> Iterator[None]:
        """torch's float32 matmul precision set to ``fp32_precision`` for the body, the caller's
        restored after it (a host-side flag: no device work, no sync)."""
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.fp32_precision)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)

    def flops(self, rows: int, cols: int) -> int:
        """FLOPs of one ``rows × cols`` matrix with these settings (``method_flops``)."""
        return method_flops(self.method, rows, cols, self.steps, self.restarts)

    @property
    def dtype_bytes(self) -> int:
        return self.dtype.itemsize
