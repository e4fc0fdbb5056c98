"""Timeline simulation of training steps from the cost model (pipeline schedules so far)."""
from .pipeline import PipelineTimeline, schedule_order, simulate_actions, simulate_pipeline
from .step import (Event, LayerSim, StageSim, StepResult, StepSim, interleaved_order, rank_orders,
                   simulate_step)
from .timeline import plot_gantt, to_chrome_trace

__all__ = ["PipelineTimeline", "schedule_order", "simulate_actions", "simulate_pipeline",
           "Event", "LayerSim", "StageSim", "StepResult", "StepSim", "interleaved_order", "rank_orders",
           "simulate_step", "plot_gantt", "to_chrome_trace"]
