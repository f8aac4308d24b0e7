"""Planning: every decision of a step, made once, as pure functions of shapes and sizes.

No process group here (no ``torch.distributed`` import): a plan for 512 ranks is built on one
process, and every rank builds the same plan from the same inputs, which is what lets the
collectives of ``parallel/`` line up without asking each other.

The decisions:

    step_plan        ``StepPlan``: DP owners, micro-groups, TP modes, TP owners, scales, and the
                     per-rank FLOPs and bytes of one step, for every rank of a stage
    units            the pieces placed apart: a weight, or fc1's gate and up
    owners           ``plan_owners`` (LPT on Newton–Schulz cost) and the DP owner plan
    exchange         who sends which elements to whom (``Piece``, ``OwnedMatrix``); micro-groups
    grid_schedule    ``--muon-tp-mode auto``: DP group and width of every unit on the TP x DP grid
    teams            auto at TP 1: a node's consecutive DP ranks share a unit
    topology         the rank map: which plan positions share a node
    local_blocks     ``--muonbp-block local``: the blocks of a DP rank's own rows
    balanced_layout  the ZeRO-1 buffer layout in which no Muon matrix is cut across DP
    digest           a plan as per-field digests, compared across ranks at construction

The price (one of each):

    pricing          what a sub-matrix costs a rank in a TP mode, and what a plan costs per rank
    hardware         the hardware profiles and ``--muon-auto-hardware``
    cost_model       ``Cost`` and the primitives' seconds (NS, collectives, memory passes)
    mode_cost        one ``orthogonalize_sharded`` call's cost: the price of its one-group plan
    auto_mode        ``auto``'s one-TP-group choice (``choose_tp_modes``)
    step_cost        a whole optimizer step on a TP x DP x PP layout, ours read from its plan
    iteration        a whole training iteration: the pipeline, Megatron's DDP buckets, the step

The road from a model to its layouts, without building it:

    stage_params     a stage's params as megatron-core registers them
    stage_layouts    its DDP buffer (balanced, or megatron-core's packing replayed) and its MatrixLayouts
    param_marks      a param's marks and the ``MatrixLayout`` the catalogue gives it
"""
