"""Shapes of models and of RL steps, shared by ``lightning-dta plan`` and ``lightning-dta bench``: model presets
and the benchmark model (``models``), seeded workloads with the shapes of real post-training steps
(``workloads``)."""
