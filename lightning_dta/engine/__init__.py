"""The tree engine: ``tree_backward`` (training) and ``tree_logprobs`` / ``tree_values`` (forward only), configured
by :class:`EngineOptions`.

Modules: ``options`` (every option), ``backward`` / ``logprobs`` (the two entry points), ``walk`` (the
depth-first traversal both share, and the engine's vocabulary: node, chunk, sibling batch), ``dfs`` (the
training walk), ``vanilla`` / ``mask`` (the baselines), ``sibling_batch`` (packed and padded layouts),
``forward`` (one forward of a sibling batch), ``prefix_attention`` (the kernel and the attention switch),
``kv`` (keys/values: the ``KV`` type, the recorder, the path buffers), ``model_info`` (what the engine checks on
a model), ``step_data`` (per-token loss inputs), ``token_scores`` (log-probs without full-vocabulary copies).
"""

from lightning_dta.engine.backward import TreeBackwardOutput, tree_backward
from lightning_dta.engine.errors import ModelNotSupportedError
from lightning_dta.engine.logprobs import tree_logprobs, tree_values
from lightning_dta.engine.options import EngineOptions
from lightning_dta.engine.step_data import tree_loss_normalizer

__all__ = ["EngineOptions", "ModelNotSupportedError", "TreeBackwardOutput", "tree_backward", "tree_logprobs",
           "tree_loss_normalizer", "tree_values"]
