"""What a chunked prefill moves between the device and the host store (issue 54).

On CUDA a copy between host and device is asynchronous only when both sides are contiguous and the host side is
page-locked: PyTorch copies a strided tensor through a contiguous temporary in pageable memory and waits. On CPU the
same code runs, so the prefill's copies are checked here: every non-blocking copy has contiguous operands (the
store's chunks hold `(B, H_kv, tokens, D)`, so a range of positions is strided; `copy_block` moves one (sequence,
KV head) at a time). The bytes: each prompt token reaches the host once (linear in the prompt); the earlier chunks
come back at every later chunk (quadratic for a fixed chunk size, by design: `DualLayer.prefill_kv`).
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dual_cache.host.pages import copy_block
from tests.conftest import six_layer_llama

OPTIONS = {"budget": 12, "n_sink": 4, "window": 8, "early_layers": 0, "prefill_chunk_size": 64}


class NonBlockingCopies(TorchFunctionMode):
    """Records, for every `Tensor.copy_` / `Tensor.to` asked to be non-blocking, whether both sides are contiguous
    and how many bytes it moves."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[bool, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.copy_ and (kwargs.get("non_blocking") or (len(args) > 2 and args[2])):
            self.copies.append((args[0].is_contiguous() and args[1].is_contiguous(), args[1].nbytes))
        elif func is torch.Tensor.to and kwargs.get("non_blocking"):
            self.copies.append((args[0].is_contiguous(), args[0].nbytes))
        return result


def _prefill(model, prompt_tokens: int):
    ids = torch.randint(3, 90, (2, prompt_tokens), generator=torch.Generator().manual_seed(prompt_tokens))
    with NonBlockingCopies() as copies:
        out = model.generate(ids, max_new_tokens=1, do_sample=False, cache_implementation="dual",
                             cache_config=OPTIONS, return_dict_in_generate=True)
    layers = out.cache.dual_layers
    return (sum(layer.host.bytes_to_host for layer in layers), sum(layer.host.bytes_to_device for layer in layers),
            copies.copies, len(layers))


def test_prefill_copies_are_contiguous_and_the_host_writes_grow_linearly():
    model = six_layer_llama(seed=3)
    config = model.config
    chunk, window = OPTIONS["prefill_chunk_size"], OPTIONS["window"]
    per_token = 2 * 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4  # K+V
    measured = {}
    for tokens in (256, 512):
        to_host, to_device, copies, layers = _prefill(model, tokens)
        assert copies and all(contiguous for contiguous, _ in copies), [c for c in copies if not c[0]][:3]
        chunks = tokens // chunk
        assert to_host == layers * tokens * per_token  # each prompt token reaches the host once
        # earlier chunks re-read at each later chunk (dense attention over the prompt so far), then the window
        assert to_device == layers * (chunk * chunks * (chunks - 1) // 2 + window) * per_token
        assert sum(nbytes for _, nbytes in copies) == to_host + to_device  # nothing else crosses
        measured[tokens] = to_host
    assert measured[512] == 2 * measured[256]


def test_a_strided_block_is_refused():
    chunk = torch.zeros(2, 3, 16, 4)  # (B, H_kv, tokens, D)
    with pytest.raises(RuntimeError, match="contiguous"):
        copy_block(chunk[:, :, 2:6], torch.ones(2, 3, 4, 4))  # a range of positions across sequences and heads
    copy_block(chunk[1, 2, 2:6], torch.ones(4, 4))  # one (sequence, KV head): contiguous
    assert chunk.sum() == 16
