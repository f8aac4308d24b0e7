"""The memory traffic of a Newton–Schulz call beside its GEMMs: what the FLOP counts leave out.

A quintic step's two accumulating products, ``baddbmm(A, A, A)`` and ``baddbmm(X, B, X)``, first
copy their ``self`` operand into a fresh result (torch's out-of-place ``addmm`` family does, on
CPUs and on CUDA) and only then run the GEMM into it with ``beta``; the normalization reads the
matrix for its max |x| and its norm and writes it twice; the executors stack same-shape
matrices into one batch and file the results out again. None of that is a FLOP, all of it is
bytes, and on a matrix whose short side is small it is a real share of the call: 256 × 448 fp32,
five steps, touches about 27 matrix-sized passes against 5 × (4·256 + 2·256²/448) ≈ 6600 FLOPs
per element.

Counts are elements read plus elements written (a copy is 2 per element), in the NS dtype; the
pricing multiplies by its element size and divides by the profile's memory bandwidth. Pure: no
torch.distributed, no Megatron.

Per call on an ``a × b`` matrix (a the short side):
    standard   11·ab (normalization 7: max and min reads, the scaling r+w, the norm read, the
               division r+w; the batch stack and the filing of the result 4) + per step
               2(a² + ab) (the copies of A and X into the two products' results)
    Gram       11·ab + per step 5a² (the copy of R into M's product, ``add_(eye)`` r+r+w) and per
               restart block a² (the identity written)
    distributed, on a ``k × cols`` column shard: 13·k·cols (the normalization with its squared
               temporary 9, stack and filing 4) + per step the Gram's casts to and from fp32
               (4k², none when NS runs in fp32) and its product form's copies
               (``sharded_pass_elements``)
"""

from __future__ import annotations

from .newton_schulz import (
    NSOptions,
    gram_block_rows,
    gram_blocks,
    reassociates,
    runs_gram,
    sharded_runs_gram,
    splits_gram,
)

__all__ = ["pass_bytes", "pass_elements", "sharded_pass_bytes", "sharded_pass_elements"]


def pass_elements(ns: NSOptions, rows: int, cols: int) -> int:
    """Elements touched outside the GEMMs by one ``rows × cols`` matrix's NS call with ``ns``."""
    a, b = min(rows, cols), max(rows, cols)
    if runs_gram(ns.method, rows, cols):
        return 11 * a * b + sum((5 * len(block) + 1) * a * a for block in gram_blocks([None] * ns.steps, ns.restarts))
    return 11 * a * b + ns.steps * 2 * (a * a + a * b)


def sharded_pass_elements(ns: NSOptions, k: int, cols: int, ranks: int) -> int:
    """Elements one rank touches outside the GEMMs in the distributed mode's NS of a ``k × cols``
    column shard whose Gram (k × k) is summed over ``ranks`` ranks."""
    fixed = 13 * k * cols
    # each Gram summed in fp32 (``parallel.tp_modes.REDUCE_DTYPE``): cast there and back, unless
    # the NS already runs in fp32
    casts = 0 if ns.dtype_bytes == 4 else 4 * k * k
    if sharded_runs_gram(ns.method, k, cols, ranks):
        return fixed + sum(casts + (5 * len(block) + 1) * k * k
                           for block in gram_blocks([None] * ns.steps, ns.restarts))
    if splits_gram(k, cols, ranks):
        # its rows of B: zeroed, formed (a copy), placed; the gathered B re-laid whole; X's copy
        rows = gram_block_rows(k, ranks)
        product = 5 * rows * k + 2 * ranks * rows * k + 2 * k * cols
    elif reassociates(k, cols):  # the copy of A·X into the second product, then + a·X (r, r, w)
        product = 5 * k * cols
    else:
        product = 2 * k * k + 2 * k * cols
    return fixed + ns.steps * (casts + product)


def pass_bytes(ns: NSOptions, rows: int, cols: int) -> int:
    """``pass_elements`` in bytes of the NS dtype."""
    return pass_elements(ns, rows, cols) * ns.dtype_bytes


def sharded_pass_bytes(ns: NSOptions, k: int, cols: int, ranks: int) -> int:
    """``sharded_pass_elements`` in bytes of the NS dtype."""
    return sharded_pass_elements(ns, k, cols, ranks) * ns.dtype_bytes
