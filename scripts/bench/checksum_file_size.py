"""The checksum file's size at a layout, counted from how megatron-core 0.19.2's torch_dist
writer stores items (``integrity.py`` keeps one digest per stored item).

    python -m scripts.bench.checksum_file_size --model llama3-405b --tp 8 --pp 16 --dp 64

Every ``ShardedTensor`` chunk (and ``ShardedObject``) one rank writes is one DCP ``WriteItem``:
one blob in a ``.distcp`` file and one ``[offset, length, SHA-256]`` entry in
``megatron_muon_checksums.json``. Replicas are written once (fully parallel save deals them to
DP ranks), so the file holds one entry per unique chunk of the whole checkpoint:

* model weights: per layer the four TP-cut matrices (qkv, proj, fc1, fc2) in ``tp`` chunks each
  and the two norms (TP-replicated: one chunk); the embedding and output layer in ``tp`` chunks,
  the final norm in one;
* optimizer state, ``fully_reshardable`` (model space): each weight chunk once per state tensor
  (``param`` and Muon's ``momentum_buffer``, or AdamW's ``exp_avg`` / ``exp_avg_sq``);
* optimizer state, ``dp_reshardable`` (megatron-core's default): per TP x PP rank, per DDP
  bucket, per state tensor, one chunk for each piece of a param inside one DP rank's shard of
  the bucket (``sharded_param_state_dp_reshardable``), so a 64-way DP cuts every bucket into at
  least 64 items.

Megatron's DDP packs params in reverse order into buckets of ``max(40M, 1M x dp)`` elements (a
bucket closes at the first param that reaches the size), each bucket padded to a multiple of
``dp``; ``dp`` shards of equal size. Alignment padding (64 elements per param start) moves
boundaries by less than a shard and is left out. Counted, not written: nothing here is a
measurement of a file system.
"""

from __future__ import annotations

import argparse
import json

from megatron_muon.core.models import LLAMA3

__all__ = ["entry_bytes", "items_dp_reshardable", "items_fully_reshardable", "items_model", "stage_params"]


def stage_params(shape, tp: int, pp: int, stage: int) -> list[tuple[int, int]]:
    """``(TP-local numel, state tensors)`` of each param of pipeline ``stage``, in model order: a
    Muon matrix has ``param`` and ``momentum_buffer``, the rest (AdamW) ``param``, ``exp_avg`` and
    ``exp_avg_sq``. Layers split as ``scripts/dry_run.py`` splits them (405B at PP16: 7 + 14 x 8 + 7)."""
    layers = shape.num_layers
    middle = -(-layers // pp) if layers % pp else layers // pp
    rest = layers - middle * (pp - 2)
    counts = [rest // 2] + [middle] * (pp - 2) + [rest - rest // 2] if layers % pp else [layers // pp] * pp
    h, heads, kv, d, ffn = shape.hidden, shape.num_heads, shape.num_query_groups, shape.head_dim, shape.ffn_hidden
    layer = [(h, 3), ((heads + 2 * kv) * d * h // tp, 2), (h * heads * d // tp, 2),
             (h, 3), (2 * ffn * h // tp, 2), (h * ffn // tp, 2)]
    params = [(shape.vocab * h // tp, 3)] if stage == 0 else []
    params += layer * counts[stage]
    params += [(h, 3), (shape.vocab * h // tp, 3)] if stage == pp - 1 else []
    return params


def items_model(shape, tp: int, pp: int) -> int:
    """Unique model-weight chunks of the checkpoint: a norm (numel ``hidden``) is one, a TP-cut weight ``tp``."""
    return sum(1 if numel == shape.hidden else tp for s in range(pp) for numel, _ in stage_params(shape, tp, pp, s))


def items_fully_reshardable(shape, tp: int, pp: int) -> int:
    """Optimizer-state chunks in model space: each weight chunk once per state tensor."""
    return sum((1 if numel == shape.hidden else tp) * keys
               for s in range(pp) for numel, keys in stage_params(shape, tp, pp, s))


def items_dp_reshardable(shape, tp: int, pp: int, dp: int) -> int:
    """Optimizer-state chunks in bucket space: for every TP rank of every stage, per bucket, per
    state tensor, the pieces of the bucket's params cut at its ``dp`` shard boundaries."""
    bucket_size = max(40_000_000, 1_000_000 * dp)
    total = 0
    for stage in range(pp):
        buckets, current = [], []
        for param in reversed(stage_params(shape, tp, pp, stage)):
            current.append(param)
            if sum(n for n, _ in current) >= bucket_size:
                buckets.append(current)
                current = []
        if current:
            buckets.append(current)
        for bucket in buckets:
            numel = sum(n for n, _ in bucket)
            shard = -(-numel // dp)
            start = 0
            for n, keys in bucket:  # a param from start to start + n crosses shard boundaries
                pieces = (start + n - 1) // shard - start // shard + 1
                total += pieces * keys * tp
                start += n
    return total


def entry_bytes() -> float:
    """Bytes one item's entry takes in ``megatron_muon_checksums.json`` (``write_checksums``'
    ``json.dumps(indent=1)``), from a written table of 1,000 items at 12-digit offsets."""
    items = [[10**11 + i * 10**8, 10**8, "0" * 64] for i in range(1000)]
    table = {"version": 2, "files": {"__1234_0.distcp": {"bytes": 10**12, "items": items}}}
    empty = {"version": 2, "files": {"__1234_0.distcp": {"bytes": 10**12, "items": []}}}
    return (len(json.dumps(table, indent=1)) - len(json.dumps(empty, indent=1))) / len(items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-405b", choices=[f"llama3-{k.lower()}" for k in LLAMA3])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--dp", type=int, default=64)
    args = parser.parse_args()
    shape = LLAMA3[args.model.removeprefix("llama3-").upper()]
    model = items_model(shape, args.tp, args.pp)
    per_entry = entry_bytes()
    world = args.tp * args.pp * args.dp
    print(f"{args.model} TP{args.tp} x PP{args.pp} x DP{args.dp} ({world} ranks); {per_entry:.0f} bytes per entry")
    for name, optim in (("fully_reshardable", items_fully_reshardable(shape, args.tp, args.pp)),
                        ("dp_reshardable", items_dp_reshardable(shape, args.tp, args.pp, args.dp))):
        items = model + optim
        print(f"  {name:17s}: {model} model + {optim} optimizer items = {items} "
              f"({items / world:.1f} per rank), checksum file {items * per_entry / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
