"""The engine's refusal: raised at the boundary, before anything is trained."""

from lightning_dta.core.errors import UsageError


class ModelNotSupportedError(UsageError, TypeError):
    """The model cannot be trained on a prefix tree (no KV cache, or a setting that breaks exactness)."""
