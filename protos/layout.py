"""The parallel layout of a training job: how its processes split the work (torch-free).

One mesh of `pp x dp x cp x tp` processes (outermost to innermost: tensor parallel talks the
most, so its ranks are neighbours, on one node). The data-parallel degree is not configured: it
is what the world size leaves once tensor, pipeline and context parallel have taken theirs.
The trainer builds its DeviceMesh from `ParallelLayout.dims()` (trainer/parallel/mesh.py),
the validation checks it (protos/validation_layout.py) and the planner prices it
(trainer/sizing/comm.py).
"""

import dataclasses
import enum

from protos import trainer_config_pb2


class Schedule(enum.Enum):
    """trainer_config.proto's PipelineSchedule, by name."""

    GPIPE = "GPIPE"
    ONE_F_ONE_B = "ONE_F_ONE_B"
    INTERLEAVED_1F1B = "INTERLEAVED_1F1B"


# Mesh dimension names, outermost first. A new kind of parallelism (experts, #18) adds its
# name here and a degree in ParallelLayout.dims().
MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1  # pipeline stages per pipeline rank
    fsdp: bool = False  # the data-parallel dimension shards (FSDP) rather than replicates

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def model_parallel(self) -> bool:
        """Anything beyond plain data parallelism (DDP and FSDP keep their own path)."""
        return self.tp * self.pp * self.cp > 1

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, degree) of every mesh dimension, outermost first; degree-1 ones included, so
        `mesh["tp"]` always exists."""
        degrees = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        return tuple((name, degrees[name]) for name in MESH_DIMS)

    def describe(self) -> str:
        """`dp2 x tp2+sp`, `pp2(INTERLEAVED_1F1B x2) x dp2`: degree-1 dimensions left out."""
        parts = [f"pp{self.pp}({self.schedule.value}x{self.virtual_stages})"] if self.pp > 1 else []
        if self.dp > 1:
            parts.append(f"{'fsdp' if self.fsdp else 'dp'}{self.dp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        return " x ".join(parts) or "single"


def from_train(t: trainer_config_pb2.TrainConfig, world_size: int) -> ParallelLayout:
    """The layout of a defaulted TrainConfig on `world_size` processes. The data-parallel
    degree is world_size // (tp * pp * cp); validation says when that does not divide."""
    model = t.tensor_parallel * t.pipeline_parallel * t.context_parallel
    schedule = trainer_config_pb2.PipelineSchedule.Name(t.pipeline_schedule)
    return ParallelLayout(
        dp=max(1, world_size // max(model, 1)),
        tp=t.tensor_parallel,
        pp=t.pipeline_parallel,
        cp=t.context_parallel,
        sequence_parallel=t.sequence_parallel,
        schedule=Schedule(schedule),
        virtual_stages=t.pipeline_virtual_stages,
        fsdp=t.parallelism == trainer_config_pb2.FSDP,
    )
