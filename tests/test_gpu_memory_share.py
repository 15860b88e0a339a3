"""--gpu-memory-utilization as vLLM reads it: the engine's share, ceil(total x utilization),
must be free at start; memory other processes hold is outside the share, never subtracted
from it."""

from __future__ import annotations

import math

import pytest

from aioinfer.sizing import (
    GiB,
    check_free_at_start,
    kv_bytes_left,
    requested_bytes,
    short_of_free_memory,
)

TOTAL = 80 * GiB
CONTEXT = GiB // 2  # each process's CUDA context, outside every share


def test_the_share_is_the_rounded_up_fraction_of_the_whole_device():
    assert requested_bytes(TOTAL, 0.92) == math.ceil(TOTAL * 0.92)
    assert requested_bytes(1001, 0.5) == 501
    assert requested_bytes(TOTAL, 1.0) == TOTAL


def test_two_servers_at_045_fit_on_one_gpu_and_a_third_does_not():
    """The case the old rule refused: the second server's KV cache was sized from the share
    minus the first server's memory."""
    free = TOTAL
    for _ in range(2):
        free -= CONTEXT  # the server's process creates its context, then checks
        check_free_at_start(free, TOTAL, 0.45)
        free -= requested_bytes(TOTAL, 0.45)  # it then fills its share
    with pytest.raises(ValueError) as refused:
        check_free_at_start(free - CONTEXT, TOTAL, 0.45)
    message = str(refused.value)
    assert "--gpu-memory-utilization" in message
    assert f"({(free - CONTEXT) / GiB:.2f}/80.00 GiB)" in message
    assert "(0.45, 36.00 GiB)" in message


@pytest.mark.parametrize("held_by_others", [0, 10 * GiB, 39 * GiB])
def test_what_others_hold_does_not_shrink_the_kv_cache(held_by_others):
    free = TOTAL - held_by_others - CONTEXT
    assert short_of_free_memory(free, TOTAL, 0.5) is None
    requested = requested_bytes(TOTAL, 0.5)
    consumed, activations = 3 * GiB, GiB  # weights and cuBLAS; the profile's peak
    assert kv_bytes_left(requested, consumed, activations, 0.5) == 36 * GiB


def test_a_share_smaller_than_the_engine_needs_is_refused_with_the_numbers():
    requested = requested_bytes(8 * GiB, 0.5)
    with pytest.raises(ValueError, match="No memory is left for the KV cache") as refused:
        kv_bytes_left(requested, 3 * GiB, GiB, 0.5)
    assert "--gpu-memory-utilization" in str(refused.value)
    assert "(4.00 GiB)" in str(refused.value)
    assert kv_bytes_left(requested, 3 * GiB, GiB // 2, 0.5) == GiB // 2


def test_the_memory_a_process_may_use_is_its_container_s_limit_where_lower(tmp_path):
    """cgroup v2 writes "max" for no limit, v1 a huge number: neither lowers the machine's."""
    from aioinfer.sizing import host_memory_bytes

    machine = host_memory_bytes(limit_files=())
    assert machine is not None and machine > 0
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text(f"{2**63 - 4096}\n")
    assert host_memory_bytes(limit_files=(str(v2), str(v1))) == machine
    v2.write_text(f"{GiB}\n")
    assert host_memory_bytes(limit_files=(str(v2), str(tmp_path / "absent"))) == GiB
