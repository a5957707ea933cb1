"""`check_resources`: a size the machine cannot hold, or a CUDA device it lacks, is one
`ConfigError` before anything is allocated; the sizes it counts are what start allocates."""

from __future__ import annotations

import re

import numpy
import pytest
import torch

from hicache.actors import DeviceCore, HostCore
from hicache.actors._pages import SlotTable
from hicache.messages._resources import host_available_bytes, needs
from hicache.runtime import Available, Config, ConfigError, check_resources

GIB = 1 << 30
SHAPE = {"layers": 2, "kv_heads": 1, "head_dim": 64, "dtype": "float16", "page_size": 16}
"""512 bytes of K and V a slot, 8 KiB a page."""


def _plenty(cuda: bool = True) -> Available:
    return Available(cuda=cuda, device_free_bytes=80 * GIB if cuda else None, host_free_bytes=512 * GIB)


def test_cuda_without_a_cuda_device_is_one_line_that_says_what_to_do() -> None:
    config = Config(device="cuda")  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        check_resources(config, Available(cuda=False, device_free_bytes=None, host_free_bytes=512 * GIB))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("device='cuda' but torch ")
    assert message.endswith("run on a machine with an NVIDIA GPU and a CUDA build of torch, or set device='cpu'")


def test_on_this_machine_cuda_is_refused_exactly_when_torch_has_no_cuda() -> None:
    config = Config(device="cuda", device_slots=64, host_slots=128)  # type: ignore[arg-type]
    if torch.cuda.is_available():
        check_resources(config)
    else:
        with pytest.raises(ConfigError, match=r"^device='cuda' but torch .* finds no usable CUDA device"):
            check_resources(config)


def test_a_device_buffer_larger_than_free_device_memory_names_device_slots_and_what_fits() -> None:
    config = Config(**SHAPE, device="cuda", device_slots=10**12, host_slots=2**40)  # type: ignore[arg-type]
    available = Available(cuda=True, device_free_bytes=1 * GIB, host_free_bytes=2**60)
    with pytest.raises(ConfigError) as info:
        check_resources(config, available)
    message = str(info.value)
    assert message.startswith("the cache needs 465.7 TiB of CUDA device memory but 1.0 GiB is free: device KV "
                              "buffer (device_slots=1000000000000 x 512 B a slot) 465.7 TiB; ")
    fit = int(re.search(r"lower device_slots to at most (\d+),", message).group(1))  # type: ignore[union-attr]
    assert fit == GIB // 512
    check_resources(config.replace(device_slots=fit), available)
    with pytest.raises(ConfigError, match="CUDA device memory"):
        check_resources(config.replace(device_slots=fit + 16), available)


def test_a_host_buffer_larger_than_free_host_memory_names_host_slots_and_what_fits() -> None:
    config = Config(**SHAPE, device_slots=1024, host_slots=2**30)
    available = Available(cuda=False, device_free_bytes=None, host_free_bytes=4 * GIB)
    with pytest.raises(ConfigError, match=r"^the cache needs 513\.1 GiB of host memory but 4\.0 GiB is free: ") as info:
        check_resources(config, available)
    fit = int(re.search(r"lower host_slots to at most (\d+),", str(info.value)).group(1))  # type: ignore[union-attr]
    check_resources(config.replace(host_slots=fit), available)
    with pytest.raises(ConfigError, match="host memory"):
        check_resources(config.replace(host_slots=fit + 16), available)


def test_on_cpu_the_device_buffer_counts_against_host_memory() -> None:
    config = Config(**SHAPE, device_slots=2**21, host_slots=2**22)  # 1 GiB + 2 GiB of KV
    check_resources(config, Available(cuda=False, device_free_bytes=None, host_free_bytes=4 * GIB))
    with pytest.raises(ConfigError, match=r"device KV buffer \(device_slots=2097152 x 512 B a slot\) 1\.0 GiB \+ "
                                          r"host KV buffer \(host_slots=4194304 x 512 B a slot\) 2\.0 GiB"):
        check_resources(config, Available(cuda=False, device_free_bytes=None, host_free_bytes=3 * GIB))


def test_the_mooncake_segment_is_counted() -> None:
    config = Config(**SHAPE, device_slots=64, host_slots=128, storage="mooncake",  # type: ignore[arg-type]
                    storage_batch_pages=4096, mooncake_segment_mb=1 << 20)
    with pytest.raises(ConfigError, match=r"Mooncake segment \(mooncake_segment_mb=1048576\) 1\.0 TiB; "
                                          r"lower mooncake_segment_mb, host_slots, device_slots$"):
        check_resources(config, _plenty())
    check_resources(config.replace(mooncake_segment_mb=256), _plenty())


def test_what_cannot_be_told_is_not_checked() -> None:
    huge = Config(**SHAPE, device="cuda", device_slots=2**39, host_slots=2**40)  # type: ignore[arg-type]
    check_resources(huge, Available(cuda=True, device_free_bytes=None, host_free_bytes=None))


def test_the_counted_sizes_are_what_the_pools_allocate() -> None:
    config = Config(**SHAPE, device_slots=256, host_slots=1024, storage="file", storage_dir="/unused",  # type: ignore[arg-type]
                    storage_batch_pages=3)
    counted: dict[str, int] = {}
    for n in needs(config):
        counted[n.field] = counted.get(n.field, 0) + n.nbytes
    device, host = DeviceCore(config), HostCore(config)
    every = frozenset(range(256))
    assert host._states.fits(numpy.arange(host._states.size), every)  # a first check of many pages makes its table
    free_codes = frozenset(range(-device._owners.size, 0))  # a free page's code: its place in the free list
    assert device._owners.move(numpy.arange(device._owners.size), free_codes, 2)  # the device's check in place: none
    assert device._owners._scratch is None

    def table_bytes(core: DeviceCore | HostCore) -> int:
        table = core._owners if isinstance(core, DeviceCore) else core._states
        scratch = 0 if table._scratch is None else table._scratch.nbytes
        codes = len(table._marks) if isinstance(core, DeviceCore) else 0  # made at the start: every page is free
        return table.view.nbytes + scratch + codes + core._pool._stack.nbytes

    slot_table = SlotTable(config.device_pages, config.page_size)._rows.nbytes  # the facade's
    assert counted["device_slots"] == device.kv.tensor.nbytes + table_bytes(device) + slot_table
    assert counted["host_slots"] == host.kv.tensor.nbytes + table_bytes(host)
    assert "storage_batch_pages" not in counted  # storage reads and writes host slots in place: no buffer


def test_this_machine_reports_its_free_host_memory_and_refuses_half_a_petabyte() -> None:
    free = host_available_bytes()
    assert free is not None and 0 < free < 2**49
    check_resources(Config())
    with pytest.raises(ConfigError, match=r"^the cache needs 513\.1 TiB of host memory but .* is free: "):
        check_resources(Config(**SHAPE, device_slots=16, host_slots=2**40))
