"""Coming from another trainer: ``convert`` (the ``lightning-dta convert`` verb: TRL, verl or AReaL settings as a
``fit`` config fragment, through :mod:`lightning_dta.core.conversions`) and ``trl`` (:class:`DTAGRPOTrainer`, TRL's
``GRPOTrainer`` with a tree walk for its training step; needs ``pip install -e ".[trl]"``). Importing this package
imports neither."""
