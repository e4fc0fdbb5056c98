"""Activation memory: predicted from graphs (``simulate``, with ``storage`` and Inductor's kernels in
``inductor_model``) and measured on a real step (``measure``); the parameter gradients a step
allocates (``param_grads``) and their accumulation inside the compiled backward (``grad_in_graph``)."""
from .measure import StepMeasurement, measure_step
from .simulate import StepMemory, simulate_graph, simulate_step
from .storage import storage_keys

__all__ = ["StepMeasurement", "measure_step", "StepMemory", "simulate_graph", "simulate_step", "storage_keys"]
