"""Planning: every decision of a step, made once, as pure functions of shapes and sizes.

No process group here (no ``torch.distributed`` import): a plan for 512 ranks is built on one
process, and every rank builds the same plan from the same inputs, which is what lets the
collectives of ``parallel/`` line up without asking each other.

    owners           ``plan_owners`` (LPT on Newton–Schulz cost) and the DP owner plan
    exchange         who sends which elements to whom (``Piece``, ``OwnedMatrix``); micro-groups
    balanced_layout  the ZeRO-1 buffer layout in which no Muon matrix is cut across DP
    cost_model       predicted step time per TP mode from shapes, layout and hardware constants
    auto_mode        ``--muon-tp-mode auto``: the cheapest exact mode per matrix class
    step_plan        ``StepPlan``: DP owners, micro-groups, TP modes, TP owners, scales, and the
                     per-rank FLOPs and bytes of one step, for every rank of a stage
"""
