"""Silencing, by exact message, the warnings a lightning_dta run would otherwise print although nothing is wrong.

Each filter names what it silences and why it is safe; everything else still prints.
- ``IterableDataset has __len__ defined``: ``RolloutDataModule``'s dataset has a length on purpose (Lightning would
  otherwise prefetch a step of an online source, one step off policy) and is never used with worker processes.
- ``isinstance(treespec, LeafSpec) is deprecated``: Lightning 2.6's own code on torch >= 2.10; nothing to change
  on our side.
- ``FSDP2-wrapped module (...) returned a view tensor``: under tensor parallelism the LM head's gathered logits come
  back as a view of the all-gather's buffer. FSDP2 warns that an in-place op on such a view would skip its
  pre-backward all-gather; a tree walk runs with every unit unsharded and no FSDP collective
  (:mod:`lightning_dta.distributed.sharding`) and never writes into the logits, so nothing is skipped.
- Lightning's "Tip: ... litlogger" advertisement, printed on every run.
"""

from __future__ import annotations

import logging
import warnings

WARNINGS = (r"Your `IterableDataset` has `__len__` defined", r"`isinstance\(treespec, LeafSpec\)` is deprecated",
            r"FSDP2-wrapped module \(.*\) returned a view tensor")
LOG_ADVERTS = ("💡 Tip: For seamless cloud logging",)


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LOG_ADVERTS)


def install() -> None:
    """Add the filters (idempotent: warnings.filterwarnings de-duplicates, the log filter is added once)."""
    for message in WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdverts) for f in logger.filters):
            logger.addFilter(_DropAdverts())
