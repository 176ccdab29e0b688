"""The Lightning side: the strategies (``strategy``: replicated, ``fsdp_strategy``: FSDP2), the DFS step for a
``LightningModule`` (``step``), ``DTAModule`` (``module``) and its PPO critic (``critic``), ``RolloutDataModule``
and the step sources it reads (``data``, ``sources``), callbacks, LightningCLI (``cli``) and the filters for
warnings Lightning prints although nothing is wrong (``quiet``)."""
