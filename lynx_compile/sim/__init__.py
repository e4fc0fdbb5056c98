"""Timeline simulation of training steps from the cost model (pipeline schedules so far)."""
from .pipeline import schedule_order, simulate_pipeline, simulate_stages
from .step import (Event, LayerSim, StageSim, StepResult, StepSim, interleaved_order, rank_orders,
                   simulate_step)
from .timeline import plot_gantt, to_chrome_trace

__all__ = ["schedule_order", "simulate_pipeline", "simulate_stages",
           "Event", "LayerSim", "StageSim", "StepResult", "StepSim", "interleaved_order", "rank_orders",
           "simulate_step", "plot_gantt", "to_chrome_trace"]
