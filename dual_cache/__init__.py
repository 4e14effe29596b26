"""dual-cache: long-context decoding with the KV cache in host memory and only the entries each step needs on
the accelerator, chosen one step early from a speculated token (DualDecoder).

`import dual_cache` registers `cache_implementation="dual"` with transformers' `generate()`.
"""

from .cache import DualDecoderCache
from .host_memory import HostMemoryError
from .layer import DualLayer
from .config import DualDecoderConfig
from .integration import register
from .models import load_default_model, load_model

register()

__all__ = [
    "DualDecoderCache", "DualDecoderConfig", "DualLayer", "HostMemoryError", "load_default_model", "load_model", "register",
]
__version__ = "0.1.0"
