"""GPU placement against a real driver: NVML's memory readings, what a process holds, the
memory fraction, and CUDA's numbering of the GPUs (which must be NVML's).

Skipped where there is no GPU (CI has none); everywhere else these run against the
hardware. The placement logic itself is tested with fake readings in
``test_placement.py`` and ``test_scheduling.py``. Run on a GPU machine with
``python -m pytest --noconftest tests/test_placement_gpu.py`` (no vLLM needed: a child
process takes GPU memory with PyTorch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from router.workers.placement import ASLEEP_GIB, GIB, Placer, nvml_process_memory, read_gpus
from shared.config import ModelSpec

GPUS = read_gpus()
pytestmark = pytest.mark.skipif(not GPUS, reason="no GPU (NVML found none, or no nvidia-ml-py)")

HOLD_GIB = 4
HOLDER = f"""
import time, torch
x = torch.empty({HOLD_GIB} * 2**30, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
p = torch.cuda.get_device_properties(0)
print(p.pci_domain_id, p.pci_bus_id, p.pci_device_id, flush=True)
time.sleep(120)
"""


def nvidia_smi(*fields: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                          "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [[v.strip() for v in line.split(",")] for line in out.strip().splitlines()]


@pytest.fixture
def holder() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A process holding ``HOLD_GIB`` on the last GPU, placed as a worker would be; the
    PCI domain, bus and device of its only CUDA device."""
    pytest.importorskip("torch")
    last = max(GPUS)
    env = {**os.environ, **Placer(cores={0}).place(
        ModelSpec(id="g", model="/g", device="cuda", gpus=[last]))}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, text=True,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        bus = proc.stdout.readline().strip()
        assert bus, "the holder did not start"
        yield proc, bus
    finally:
        proc.kill()
        proc.wait()


def test_read_gpus_agrees_with_nvidia_smi() -> None:
    rows = nvidia_smi("index", "memory.total", "memory.free")
    assert sorted(GPUS) == [int(r[0]) for r in rows]
    for index, total_mib, free_mib in rows:
        gpu = GPUS[int(index)]
        assert gpu.total_bytes // 2**20 == pytest.approx(int(total_mib), abs=2)
        assert gpu.free_bytes // 2**20 == pytest.approx(int(free_mib), rel=0.05, abs=512)
        assert 0 < gpu.free_bytes <= gpu.total_bytes


def test_the_memory_fraction_is_memory_gib_over_the_gpu() -> None:
    placer = Placer(cores={0})
    spec = ModelSpec(id="g", model="/g", device="cuda", gpus=[0], memory_gib=8)
    fraction = placer.gpu_memory_utilization(spec)
    assert fraction == round(8 * GIB / GPUS[0].total_bytes, 4)
    assert 0 < fraction < 0.95


def test_a_process_s_gpu_memory_is_what_it_holds_on_the_gpu_nvml_numbers(
        holder: tuple[subprocess.Popen[str], str]) -> None:
    """``held_asleep`` reads a sleeping worker's processes through NVML, and CUDA,
    restricted by ``place``'s environment, opened the GPU of that same NVML number."""
    proc, bus = holder
    last = max(GPUS)
    import pynvml

    pynvml.nvmlInit()
    try:
        pci = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(last))
    finally:
        pynvml.nvmlShutdown()
    assert bus.split() == [str(pci.domain), str(pci.bus), str(pci.device)], (bus, pci)
    for _ in range(50):  # NVML lists a process a moment after its first allocation
        held = nvml_process_memory({proc.pid})
        if held:
            break
        time.sleep(0.1)
    assert set(held) == {last}, held
    assert HOLD_GIB <= held[last] < HOLD_GIB + 2, held  # plus its CUDA context
    spec = ModelSpec(id="g", model="/g", device="cuda", gpus=[last])
    assert Placer(cores={0}).held_asleep(spec, {proc.pid, 1}) == {f"cuda:{last}": held[last]}
    # a model whose processes hold nothing NVML can see counts the fallback
    assert Placer(cores={0}).held_asleep(spec, {1}) == {f"cuda:{last}": ASLEEP_GIB}
