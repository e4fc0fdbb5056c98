"""Timeline simulation of training steps from the cost model (pipeline schedules so far)."""
from .pipeline import schedule_order, simulate_pipeline, simulate_stages

__all__ = ["schedule_order", "simulate_pipeline", "simulate_stages"]
