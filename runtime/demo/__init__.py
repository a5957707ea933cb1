"""The demo, a small model served over the cache, and the cache simulator: what
`hicache demo` and `hicache simulate` run."""

from ._model_runner import Generation, KVObserver, ModelRunner, ModelRunnerError, PoolCache
from ._tiny_model import tiny_llama

__all__ = ["Generation", "KVObserver", "ModelRunner", "ModelRunnerError", "PoolCache", "tiny_llama"]
