# Device-only shim (not part of the package): the lent GPU machine has transformers 5.17 (the project needs
# >=5.22): drop 5.17's read-only Cache.max_cache_len property, and route generate(cache=..., or
# cache_implementation="dual") to an explicit past_key_values=DualDecoderCache.
import transformers.cache_utils as cu
if isinstance(cu.Cache.__dict__.get("max_cache_len"), property):
    del cu.Cache.max_cache_len
from transformers.generation.utils import GenerationMixin
_generate = GenerationMixin.generate
def generate(self, *args, **kwargs):
    if "cache" in kwargs:
        kwargs["past_key_values"] = kwargs.pop("cache")
    if kwargs.get("cache_implementation") == "dual":
        from dual_cache import DualDecoderCache
        kwargs.pop("cache_implementation")
        kwargs["past_key_values"] = DualDecoderCache(self.config, **(kwargs.pop("cache_config", None) or {}))
    return _generate(self, *args, **kwargs)
GenerationMixin.generate = generate
import dual_cache.kernels.dispatch as _dispatch  # triton 3.6 cannot compile the kernel (>=3.7 needed): torch reference
_dispatch.triton_import_error = lambda: "device shim: triton 3.6"
