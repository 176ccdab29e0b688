"""The engine's refusal: raised at the boundary, before anything is trained."""


class ModelNotSupportedError(TypeError):
    """The model cannot be trained on a prefix tree (no KV cache, or a setting that breaks exactness)."""
