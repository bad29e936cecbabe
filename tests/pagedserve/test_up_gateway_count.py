"""``pagedserve up``'s gateway count: ``--gateways 0`` (the default) picks it from the device, the
cores and the pools; any other value is taken as given."""

from __future__ import annotations

import pytest

from pagedserve.up import UpConfig


def test_gateways_0_picks_one_per_4_cores_on_cuda_at_most_4_a_pool() -> None:
    gpu = UpConfig(device="cuda")
    assert gpu.gateways == 0
    assert [gpu.gateway_processes(cores) for cores in (1, 4, 8, 16, 64)] == [1, 1, 2, 4, 4]
    two_pools = UpConfig(device="cuda", data_parallel_size=2)
    assert [two_pools.gateway_processes(cores) for cores in (16, 32, 128)] == [4, 8, 8]


def test_one_gateway_on_cpu_and_a_given_count_as_given() -> None:
    assert UpConfig(device="cpu").gateway_processes(64) == 1
    assert UpConfig(device="cuda", gateways=3).gateway_processes(64) == 3
    assert UpConfig(device="cpu", gateways=2).gateway_processes(1) == 2


def test_a_negative_count_is_one_clear_line() -> None:
    from pagedserve.up import run_up

    with pytest.raises(SystemExit, match=r"--gateways -1: 0 \(auto\) or more"):
        run_up(UpConfig(device="cpu", gateways=-1))
