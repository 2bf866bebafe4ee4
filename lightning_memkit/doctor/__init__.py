"""The memory doctor: what survives a step and should not (leaks), what is held past its last use,
and who made it. Core code, no Lightning import; ``MemoryDoctor`` (callbacks) and ``memkit doctor`` wire it."""

from lightning_memkit.doctor.creation import Creation
from lightning_memkit.doctor.frames import format_frame
from lightning_memkit.doctor.graphs import GraphHolder, GraphLeakReport, count_kept_graph_nodes
from lightning_memkit.doctor.leaks import CreatorGroup, LeakReport, LeakWatcher, group_by_creator
from lightning_memkit.doctor.liveness import PEAK_PARTS, LivenessReport, analyse_liveness
from lightning_memkit.doctor.recorder import CreationRecorder, creation_of
from lightning_memkit.doctor.verdict import DoctorReport, DoctorSession

__all__ = [
    "Creation",
    "GraphHolder",
    "GraphLeakReport",
    "count_kept_graph_nodes",
    "CreationRecorder",
    "CreatorGroup",
    "DoctorReport",
    "DoctorSession",
    "LeakReport",
    "LeakWatcher",
    "LivenessReport",
    "PEAK_PARTS",
    "analyse_liveness",
    "creation_of",
    "format_frame",
    "group_by_creator",
]
