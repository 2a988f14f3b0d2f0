"""Launch settings and the eager/compile switch shared by the Triton ops."""

from collections.abc import Callable

import torch
import triton

from kernels.dispatch import INTERPRET

# The widest row a one-row-per-program kernel keeps in registers at once; wider rows are an
# error for RMSNorm (no model has such a hidden size) and are looped over by cross entropy.
MAX_FUSED_SIZE = 65536

# Programs of a row-looping kernel in the interpreter, where each costs milliseconds; two still
# exercise the cross-program reduction.
INTERPRETER_PROGRAMS = 2


def on_gpu() -> bool:
    """Whether kernels compile for a real GPU (and so may autotune and size grids by SM count)."""
    return torch.cuda.is_available() and not INTERPRET


def row_settings(n_cols: int) -> tuple[int, int]:
    """BLOCK_SIZE (next power of two of the row) and num_warps for a row-per-program kernel.

    The warp counts follow Liger-Kernel's `calculate_settings`: enough threads that each holds
    a handful of elements of the row.
    """
    block = triton.next_power_of_2(n_cols)
    if block >= 32768:
        return block, 32
    if block >= 8192:
        return block, 16
    if block >= 2048:
        return block, 8
    return block, 4


def rows_per_tile(block_cols: int, n_rows: int, tile: int = 4096) -> int:
    """Rows a program handles at once so a tile holds ~`tile` elements: narrow rows are batched
    (fewer, fuller programs on a GPU; far fewer interpreted ops on CPU), wide rows go one by one."""
    return max(1, min(tile // block_cols, triton.next_power_of_2(n_rows)))


def elementwise_block(n_elements: int) -> int:
    """Elements per program of a flat elementwise kernel: 4096 on a GPU; up to 64K in the
    interpreter, where each program costs milliseconds whatever its size."""
    if on_gpu():
        return 4096
    return max(16, min(MAX_FUSED_SIZE, triton.next_power_of_2(n_elements)))


def program_count(n_rows: int, device: torch.device) -> int:
    """Programs for a kernel that loops over rows: one per SM on a GPU, a few in the interpreter."""
    if device.type == "cuda":
        return max(1, min(n_rows, torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n_rows, INTERPRETER_PROGRAMS))


def autotune_on_gpu(configs: list[triton.Config], key: list[str]):
    """`triton.autotune` over `configs` on a GPU; elsewhere over the first config only, because
    the interpreter cannot benchmark several (it raises "0 active drivers")."""
    return triton.autotune(configs=configs if on_gpu() else configs[:1], key=key)


def compile_safe(eager: Callable, op: Callable) -> Callable:
    """Calls `op` (the registered torch.library custom op) while torch.compile traces, else `eager`.

    Dynamo cannot trace a Triton launch on every backend (the interpreter reads raw storage
    pointers), so compiled graphs see an opaque custom op with a fake (shape-only) twin. Eager
    calls skip the op dispatcher, which costs ~15 us per call, as much as a small kernel.
    """

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return eager(*args)

    return call


def distinct(*args):
    """`args` with any tensor that repeats an earlier one replaced by a view of it.

    Dynamo cannot trace autograd.Function.apply when one tensor is passed to two inputs (say
    swiglu(h, h), or cos passed as sin): a view is a distinct input over the same data. Eager
    calls are left untouched."""
    if not torch.compiler.is_compiling():
        return args
    out: list[object] = []
    for a in args:
        if isinstance(a, torch.Tensor) and any(a is b for b in out):
            a = a.view_as(a)
        out.append(a)
    return tuple(out)
