"""Fitting a job into a GPU memory budget: the planner that picks the offload levers (:mod:`fastwan.offload.plan`)
and the block streamer that runs blocks whose weights live in host memory (:mod:`fastwan.offload.stream`)."""
from fastwan.offload.plan import Footprint, OffloadPlan, parse_memory, plan_offload
from fastwan.offload.stream import BlockStreamer

__all__ = ["BlockStreamer", "Footprint", "OffloadPlan", "parse_memory", "plan_offload"]
