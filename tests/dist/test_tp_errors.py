"""orthogonalize_sharded rejects bad input with an error naming the matrix, its shape, the
mode and the group size — on every rank, before any payload moves."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world

from megatron_muon import orthogonalize_sharded

WORLD = 2
GOOD = torch.ones(8, 6)


def _error_of(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "<no error>"


def _cases(rank: int):
    """name → call; the calls run in this order on every rank."""
    return {
        "unknown_mode": lambda: orthogonalize_sharded([GOOD], [0], mode="sharded"),
        "length_mismatch": lambda: orthogonalize_sharded([GOOD, GOOD], [0], mode="owner"),
        "not_2d": lambda: orthogonalize_sharded([GOOD, torch.ones(4, 3, 2)], [0, 1], mode="duplicated"),
        "bad_partition_dim": lambda: orthogonalize_sharded([GOOD], [2], mode="distributed"),
        "full_not_divisible": lambda: orthogonalize_sharded(
            [GOOD], [1], mode="owner", full_shapes=[(8, 13)]
        ),
        "full_mismatch": lambda: orthogonalize_sharded([GOOD], [0], mode="owner", full_shapes=[(8, 6)]),
        # The cross-rank checks: each rank's input is fine on its own.
        "sharded_dim_differs": lambda: orthogonalize_sharded(
            [GOOD, torch.ones(8 + rank, 6)], [0, 0], mode="duplicated"
        ),
        "partition_dim_differs": lambda: orthogonalize_sharded([GOOD], [rank], mode="owner"),
        "dtype_differs": lambda: orthogonalize_sharded(
            [GOOD, GOOD.to(torch.bfloat16 if rank else torch.float32)], [0, 0], mode="owner"
        ),
        "count_differs": lambda: orthogonalize_sharded([GOOD] * (1 + rank), [0] * (1 + rank), mode="distributed"),
        "steps_bad": lambda: orthogonalize_sharded([GOOD], [0], mode="owner", steps=0),
        "coefficients_bad": lambda: orthogonalize_sharded([GOOD], [0], mode="owner", coefficients="x"),
        # After all the rejected calls the group is still in step: a good call works.
        "still_in_step": lambda: orthogonalize_sharded([GOOD], [0], mode="owner"),
    }


def _errors_worker(rank: int, t: int) -> dict:
    return {name: _error_of(call) for name, call in _cases(rank).items()}


@pytest.fixture(scope="module")
def errors():
    return run_world(WORLD, _errors_worker)


EXPECTED = {
    "unknown_mode": [r"unknown mode 'sharded'", r"mode='sharded', group size 2"],
    "length_mismatch": [r"2 shards but 1 partition_dims", r"mode='owner', group size 2"],
    "not_2d": [r"matrix 1 must be a 2-D tensor, got shape \(4, 3, 2\)", r"mode='duplicated', group size 2"],
    "bad_partition_dim": [r"matrix 0 \(local shape \(8, 6\)\) has partition_dim 2", r"group size 2"],
    "full_not_divisible": [
        r"matrix 0 \(local shape \(8, 6\), partition_dim 1\): full dim 1 of \(8, 13\) "
        r"is not divisible by the group size 2",
        r"mode='owner'",
    ],
    "full_mismatch": [r"full shape \(8, 6\) does not match 2 shards of \(8, 6\)"],
    "sharded_dim_differs": [
        r"matrix 1 \(local shape \(\d, 6\), partition_dim 0\): ranks disagree on \(rows, cols, partition_dim\): "
        r"\[\(8, 6, 0\), \(9, 6, 0\)\]",
        r"mode='duplicated', group size 2",
    ],
    "partition_dim_differs": [r"matrix 0 .*\[\(8, 6, 0\), \(8, 6, 1\)\]", r"mode='owner', group size 2"],
    "count_differs": [r"matrices per rank \[1, 2\]", r"mode='distributed', group size 2"],
    "dtype_differs": [r"matrix 1 \(local shape \(8, 6\), partition_dim 0\): ranks disagree on its dtype: "
                      r"\['float32', 'bfloat16'\] per rank", r"mode='owner', group size 2"],
    "steps_bad": [r"steps must be an integer >= 1, got 0"],
    "coefficients_bad": [r"unknown coefficient set 'x'"],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_error_names_what_was_wrong(errors, case):
    import re

    for rank, by_case in enumerate(errors):
        message = by_case[case]
        for pattern in EXPECTED[case]:
            assert re.search(pattern, message), f"rank {rank} {case}: {message!r} lacks {pattern!r}"


def test_group_still_usable_after_rejected_calls(errors):
    assert all(e["still_in_step"] == "<no error>" for e in errors)
