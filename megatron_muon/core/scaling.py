"""Update scale of an orthogonalized matrix, by shape.

NS returns a matrix with singular values near 1, whose entries have RMS 1/sqrt(max(m, n)).
Each rule rescales that so one learning rate suits every shape. Megatron's ``--muon-scale-mode``
names (emerging-optimizers' ``get_muon_scale_factor``), with m = rows (fan-out), n = cols:

    spectral        sqrt(max(m, n))        Moonlight (arXiv 2502.16982); × 0.2 matches AdamW RMS
    shape_scaling   sqrt(max(1, m / n))    Keller Jordan's original Muon
    unit_rms_norm   sqrt(m / n)            Scion (arXiv 2502.07529)

``torch.optim.Muon``'s ``adjust_lr_fn`` multiplies the learning rate instead: "original" is
shape_scaling, "match_rms_adamw" is 0.2 × spectral. Megatron scales by the **global** shape
of the (sub-)matrix in the exact TP modes and by the local shard's shape in blockwise mode.
"""

from __future__ import annotations

import math

__all__ = ["SCALE_MODES", "muon_scale"]

SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")


def muon_scale(rows: int, cols: int, mode: str = "spectral", extra_scale_factor: float = 1.0) -> float:
    """The factor an orthogonalized rows × cols update is multiplied by before the lr step.

    0 for an empty matrix (rows or cols 0): it has no entry to update, and the ratios below
    would divide by zero.
    """
    if mode not in SCALE_MODES:
        raise ValueError(f"--muon-scale-mode: expected one of {SCALE_MODES}, got {mode!r}")
    if rows == 0 or cols == 0:
        return 0.0
    if mode == "spectral":
        base = math.sqrt(max(rows, cols))
    elif mode == "shape_scaling":
        base = math.sqrt(max(1.0, rows / cols))
    else:  # unit_rms_norm
        base = math.sqrt(rows / cols)
    return base * extra_scale_factor
