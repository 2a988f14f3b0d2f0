"""Known accelerators: dense bf16 peak FLOP/s and memory, and robust matching of device names.

The peaks are the vendors' dense (no 2:4 sparsity) bf16 tensor-core figures; fp16 is the same on
every accelerator listed. Memory is the nominal size in GiB (HBM stacks come in GiB; torch reports
slightly less as usable). Names are matched on whole tokens, so "NVIDIA H100 80GB HBM3",
"h100-sxm" and "H100" all find the SXM part, while "NVIDIA GH200 480GB" or "AMD Instinct MI300A"
(different chips) match nothing and the caller must measure or ask: never a silent default.
"""

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    key: str  # e.g. "H100-SXM": appears in the MFU basis as "table:H100-SXM"
    bf16_dense_flops: float  # FLOP/s
    memory_gib: float


ACCELERATORS = {
    a.key: a
    for a in (
        Accelerator("A100-40GB", 312e12, 40),
        Accelerator("A100-80GB", 312e12, 80),
        Accelerator("H100-SXM", 989e12, 80),
        Accelerator("H100-PCIe", 756e12, 80),
        Accelerator("H100-NVL", 835e12, 94),
        Accelerator("H200", 989e12, 141),
        Accelerator("H200-NVL", 835e12, 141),
        Accelerator("B200", 2.25e15, 180e9 / 2**30),  # 180 GB per GPU as shipped (HGX/DGX B200)
        Accelerator("MI300X", 1.3e15, 192),
    )
}


def _tokens(name: str) -> set[str]:
    return set(re.split(r"[^A-Z0-9]+", name.upper())) - {""}


def match_accelerator(name: str) -> Accelerator | None:
    """The table entry for a device name (torch.cuda.get_device_name, or a table key), or None."""
    t = _tokens(name)
    if "A100" in t:
        # Every A100 (SXM or PCIe) has the same 312 TFLOP/s; only the memory differs.
        return ACCELERATORS["A100-80GB" if "80GB" in t else "A100-40GB"]
    if "H100" in t:
        if "PCIE" in t:
            return ACCELERATORS["H100-PCIe"]
        if "NVL" in t:
            return ACCELERATORS["H100-NVL"]
        # "NVIDIA H100 80GB HBM3" is the SXM part (the PCIe card says "PCIe", HBM2e).
        return ACCELERATORS["H100-SXM"]
    if "H200" in t:
        return ACCELERATORS["H200-NVL" if "NVL" in t else "H200"]
    if "B200" in t:
        return ACCELERATORS["B200"]
    if "MI300X" in t:
        return ACCELERATORS["MI300X"]
    return None
