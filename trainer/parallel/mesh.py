"""One DeviceMesh for the whole layout, built the way torchtitan builds its mesh.

Every dimension of protos.layout.MESH_DIMS is in the mesh, degree 1 included, so code asks for
`mesh["tp"]` without checking whether tensor parallelism is on. Gradients are averaged over the
ranks that saw different tokens of the same weights: data parallel and context parallel
together, one flattened dimension "dp_cp".
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from protos.layout import ParallelLayout


@dataclasses.dataclass(frozen=True)
class Mesh:
    layout: ParallelLayout
    mesh: DeviceMesh
    replicas: DeviceMesh  # data x context, flattened: the ranks whose gradients are averaged

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.mesh[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self.mesh[name].get_group()

    def rank(self, name: str) -> int:
        """This process's coordinate along dimension `name`."""
        return self.mesh[name].get_local_rank()


def build(layout: ParallelLayout, device: torch.device) -> Mesh:
    """The mesh of `layout` over the running process group (its size must be the layout's)."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"layout {layout.describe()} needs {layout.world_size} processes, "
            f"the process group has {dist.get_world_size()}"
        )
    names, degrees = zip(*layout.dims(), strict=True)
    mesh = init_device_mesh(device.type, degrees, mesh_dim_names=names)
    return Mesh(layout, mesh, mesh["dp", "cp"]._flatten("dp_cp"))
