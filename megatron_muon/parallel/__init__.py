"""The math across a process group: executes a ``plan.StepPlan``; imports ``core`` and ``plan``,
never Megatron.

    comm            the package's collectives, ``comm_stats`` accounting, ``observe_collectives``
    devices         the device rule: where every tensor the package allocates lives
    sharding        batching keys and shard stacking for the TP modes
    owner_exchange  pieces travel to one owner rank and back (one all-to-all each way)
    owner_mode      the owner TP mode's micro-group: exchange, batched NS, exchange back
    tp_modes        the blocking TP modes (duplicated, distributed, blockwise) and input validation
    orthogonalize   the one dispatcher: ``orthogonalize_updates`` runs a rank's slice of a plan as
                    a pipeline; ``orthogonalize_sharded``, the public entry, builds a one-off plan
"""
