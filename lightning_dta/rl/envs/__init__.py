"""Multi-turn environments that run on the CPU."""

from lightning_dta.rl.envs.calculator import CalculatorEnv

__all__ = ["CalculatorEnv"]
