"""dual-cache: long-context decoding with the KV cache in host memory and only the entries each step needs on
the accelerator, chosen one step early from a speculated token (DualDecoder).

`import dual_cache` registers `cache_implementation="dual"` with transformers' `generate()`.
"""

from .cache.cache import DualDecoderCache
from .config import DualDecoderConfig
from .generate.integration import register
from .host.memory import HostMemoryError
from .layer.layer import DualLayer
from .model.loading import load_default_model, load_model

register()

__all__ = [
    "DualDecoderCache", "DualDecoderConfig", "DualLayer", "HostMemoryError", "load_default_model", "load_model", "register",
]
__version__ = "0.1.0"
