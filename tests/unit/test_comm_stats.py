"""``comm_stats`` contexts nest: each sees every collective recorded while it is open."""

from __future__ import annotations

from megatron_muon.parallel import comm


def test_nested_contexts_close_in_any_state():
    """A context opened inside another equals it (by value) until one records alone; closing it
    must close itself, not the outer one (a chained optimizer's two steps inside one count)."""
    with comm.comm_stats() as outer:
        with comm.comm_stats() as first:
            pass  # equal to outer here
        comm._record("all_to_all", 8)
        with comm.comm_stats() as second:
            comm._record("all_to_all", 4)
    assert (outer.bytes_sent, first.bytes_sent, second.bytes_sent) == (12, 0, 4)
    assert outer.bytes_by_primitive == {"all_to_all": 12}
    assert comm._active == []
