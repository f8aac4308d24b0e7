"""The math on plain tensors, on one process: nothing here knows about process groups or Megatron.

    newton_schulz   the iteration, its coefficient sets, ``ns_flops``
    scaling         the update's scale by shape (spectral / shape_scaling / unit_rms_norm)
    muon            ``Muon``, the single-process reference (torch.optim.Muon's update)
    shapes          shard ↔ full shape arithmetic under TP (the one source of it)
    models          ``ModelShape``: a GPT's weight shapes (Llama-3 8B / 70B / 405B)
    matrix_layout   one Muon matrix as the optimizer sees it: TP shard, DP ranges, fused sub-matrices
    qk_clip         QK-clip (MuonClip): per-group η, the fused QKV's row factors, on a matrix or a flat range
"""
