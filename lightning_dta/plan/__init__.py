"""``lightning-dta plan``: before a run, the memory and FLOPs of a step under every training mode, and the engine
options that fit a memory size.

The prediction runs the training walk's own schedule dry (:class:`~lightning_dta.engine.dfs.DFSSchedule`: the same
chunks, sibling batches and keep/recompute decisions) and prices every forward with activation rates probed on
one- and two-layer clones of the model (:mod:`.rates`), so no checkpoint is loaded and an 8B shape plans on a CPU.
"""

from lightning_dta.plan.flops import ModelShape
from lightning_dta.plan.predict import ModePrediction, StepPlan, plan_step
from lightning_dta.plan.rates import ActivationRates, probe_rates
from lightning_dta.plan.state import TrainingState

__all__ = ["ActivationRates", "ModePrediction", "ModelShape", "StepPlan", "TrainingState", "plan_step",
           "probe_rates"]
