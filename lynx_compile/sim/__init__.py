"""Timeline simulation of a training iteration from the cost model (pipeline x tensor parallel x
recompute, at paper scale). It builds on the pipeline schedule simulator that the stage planner
owns, ``lynx_compile.pipelining.schedule_sim`` (``simulate_pipeline``, ``simulate_actions``)."""
from .step import (Event, LayerSim, StageSim, StepResult, StepSim, interleaved_order, rank_orders,
                   simulate_iteration)
from .timeline import plot_gantt, to_chrome_trace

__all__ = ["Event", "LayerSim", "StageSim", "StepResult", "StepSim", "interleaved_order", "rank_orders",
           "simulate_iteration", "plot_gantt", "to_chrome_trace"]
