"""Single-process Muon: the reference every distributed path is compared with.

Same constructor arguments, defaults and update as ``torch.optim.Muon`` (torch 2.11):

    B ← B.lerp(g, 1 − μ)                       momentum as an EMA
    U ← g.lerp(B, μ) if nesterov else B
    O ← newton_schulz(U in ns_dtype)           bf16 by default, like torch
    θ ← θ · (1 − lr·wd)                        decoupled weight decay with the unadjusted lr
    θ ← θ − adjust_lr(lr, shape) · O

plus ``ns_dtype`` (fp32 gives a high-precision reference) and ``coefficients`` (any set of
``newton_schulz``). With the defaults the update is bitwise torch.optim.Muon's on CPU.

Its defaults are therefore torch's, not the package's: Keller Jordan's coefficients (the rest of
the package defaults to ``quintic``, upstream Megatron's) and ``nesterov=True`` (``MuonConfig``
defaults to False, as upstream's ``--muon-nesterov`` does). Pass ``coefficients="quintic"`` and
``nesterov=False`` to get the Megatron path's math.

Two more options make it the single-process reference of Megatron's Muon:
``scale_mode``/``extra_scale_factor`` scale the orthogonalized update by shape
(``scaling.muon_scale``) instead of adjusting the lr, and a param group's ``row_split``
(a ``RowSplit``) orthogonalizes fused sub-matrices (QKV per query group, fc1 gate/up) apart.
"""

from __future__ import annotations

import math

import torch

from .matrix_layout import MatrixLayout, RowSplit
from .newton_schulz import COEFFICIENT_SETS, Coefficients, coefficient_schedule, newton_schulz
from .scaling import muon_scale

__all__ = ["Muon", "adjusted_lr"]

ADJUST_LR_FNS = ("original", "match_rms_adamw")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's per-shape learning rate.

    ``original`` (Keller Jordan): lr·sqrt(max(1, rows/cols));
    ``match_rms_adamw`` (Moonlight, arXiv 2502.16982): lr·0.2·sqrt(max(rows, cols)).
    An empty matrix (rows or cols 0) has nothing to update: lr unchanged (torch's rows/cols
    would divide by zero for cols 0).
    """
    if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Muon: adjust_lr_fn must be one of {ADJUST_LR_FNS} or None, got {adjust_lr_fn!r}")
    if rows == 0 or cols == 0:
        return lr
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))  # match_rms_adamw


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters on one process.

    Args:
        params: 2-D parameters or param groups.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as in ``torch.optim.Muon``.
        ns_dtype: dtype the Newton–Schulz iteration runs in (torch uses bf16).
        coefficients: a ``newton_schulz`` coefficient set name or list; overrides
            ``ns_coefficients`` when given.
        scale_mode, extra_scale_factor: when ``scale_mode`` is set, scale each orthogonalized
            (sub-)matrix by ``muon_scale`` of its shape and step with the plain lr (Megatron's
            rule) instead of ``adjust_lr_fn``.
    Param groups may also set ``row_split`` (a ``RowSplit``, needs ``scale_mode``).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = COEFFICIENT_SETS["jordan"][0],
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        coefficients: Coefficients | None = None,
        scale_mode: str | None = None,
        extra_scale_factor: float = 1.0,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if not momentum >= 0:
            raise ValueError(f"Muon: momentum must be >= 0, got {momentum}")
        if not weight_decay >= 0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Muon: adjust_lr_fn must be one of {ADJUST_LR_FNS} or None, got {adjust_lr_fn!r}")
        if not ns_dtype.is_floating_point:
            raise ValueError(f"Muon: ns_dtype must be a floating-point dtype, got {ns_dtype}")
        coefficients = [tuple(ns_coefficients)] if coefficients is None else coefficients
        coefficient_schedule(coefficients, ns_steps)  # validates steps and the set
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            coefficients=coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            row_split=None,
        )
        super().__init__(params, defaults)
        for g, group in enumerate(self.param_groups):
            if group["row_split"] is not None and (group["scale_mode"] is None
                                                   or not isinstance(group["row_split"], RowSplit)):
                raise ValueError(f"Muon: param group {g}: row_split must be a RowSplit and needs scale_mode")
            for i, p in enumerate(group["params"]):
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon: param group {g} parameter {i} has shape {tuple(p.shape)}; Muon takes 2-D "
                        "matrices only (give biases, norms and embeddings to AdamW)"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                ns = lambda x: newton_schulz(
                    x.to(group["ns_dtype"]), group["ns_steps"], group["coefficients"], eps=group["eps"]
                )
                p.mul_(1 - lr * wd)
                if group["scale_mode"] is None:
                    p.add_(ns(update), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], *p.shape))
                    continue
                layout = MatrixLayout("", tuple(p.shape), None, 1, group["row_split"])
                parts = [
                    ns(part).float() * muon_scale(*part.shape, group["scale_mode"], group["extra_scale_factor"])
                    for part in layout.split_rows(update)
                ]
                p.add_(layout.join_rows(parts), alpha=-lr)
        return loss
