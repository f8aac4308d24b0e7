"""The math across a process group: imports ``core``, never Megatron.

    comm            the package's collectives, ``comm_stats`` accounting, ``observe_collectives``
    devices         the device rule: where every tensor the package allocates lives
    sharding        batching keys and shard stacking for the TP modes
    planner         ``plan_owners``: LPT on Newton–Schulz cost
    owner_exchange  pieces travel to one owner rank and back (one all-to-all each way)
    owner_mode      the owner TP mode: plan, exchange, batched NS, exchange back
    tp_modes        ``orthogonalize_sharded``: the one entry, dispatching by TP mode
    orthogonalize   the optimizer's step: the DP owner exchange around a TP mode
    step_plan       per rank NS FLOPs and bytes of one step, replayed from the plans
    cost_model      predicted step time per mode from shapes, layout and hardware constants
    auto_mode       ``--muon-tp-mode auto``: the cheapest exact mode per matrix
"""
