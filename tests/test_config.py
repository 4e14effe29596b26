import dataclasses
import json

import pytest

from dual_cache import DualDecoderConfig


def test_defaults_are_valid():
    config = DualDecoderConfig()
    assert config.budget == 256 and config.speculator == "self" and config.selector == "carried"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"budget": -1}, "budget"),
        ({"budget": 2.5}, "budget"),
        ({"window": 0}, "window"),
        ({"n_sink": True}, "n_sink"),
        ({"speculator": "medusa"}, "speculator"),
        ({"selector": "random"}, "selector"),
        ({"lookahead": 2, "layers_in_flight": 2}, "lookahead"),
        ({"attention_kernel": "cuda"}, "attention_kernel"),
        ({"max_host_bytes": 0}, "max_host_bytes"),
        ({"selector": "quest", "block_size": 16, "budget": 100}, "multiple of `block_size`"),
        ({"selector": "quest", "block_size": 16, "early_layer_budget": 1000}, "multiple of `block_size`"),
        ({"layers_in_flight": 0}, "layers_in_flight"),
        ({"selector": "shortlist"}, "`selector` must be one of \\('carried', 'exact', 'lowbit', 'oracle', 'quest'\\)"),
        ({"shortlist_factor": 8}, "Unknown dual cache option"),
        ({"retrieval_threads": -1}, "retrieval_threads"),
        ({"layer_budgets": {0: -5}}, "layer_budgets"),
        ({"bugdet": 3}, "Unknown dual cache option"),
        ({"repair_drift": -0.1}, "repair_drift"),
        ({"repair_drift": float("nan")}, "repair_drift"),
        ({"repair_drift": "0.4"}, "repair_drift"),
        ({"repair_drift": True}, "repair_drift"),
        ({"repair_drift": float("inf")}, "use None to turn it off"),
        ({"repair_drift": 2**2000}, "finite"),
    ],
)
def test_bad_values_raise_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        DualDecoderConfig.from_dict(options)


def test_layer_budget_override():
    config = DualDecoderConfig(budget=64, layer_budgets={"1": 512}, early_layers=1, early_layer_budget=128)
    assert config.budget_for_layer(0) == 128 and config.budget_for_layer(1) == 512
    assert config.budget_for_layer(2) == 64
    assert DualDecoderConfig(budget=2048).budget_for_layer(0) == 2048


def test_numpy_integers_are_stored_as_ints():
    import numpy as np

    config = DualDecoderConfig(budget=np.int64(128), window=np.int32(32), layer_budgets={0: np.int64(512)},
                               lowbit_factor=np.int64(4))
    assert (config.budget, config.window, config.layer_budgets[0], config.lowbit_factor) == (128, 32, 512, 4)
    assert all(type(v) is int for v in (config.budget, config.window, config.layer_budgets[0], config.lowbit_factor))
    assert json.loads(json.dumps(dataclasses.asdict(config)))["budget"] == 128  # a config written to results rows
    with pytest.raises(ValueError, match="`budget` must be an int"):
        DualDecoderConfig(budget=np.float64(128))
    with pytest.raises(ValueError, match="`window` must be >= 1"):
        DualDecoderConfig(window=np.int64(0))


def test_repair_drift_is_stored_as_a_float():
    import numpy as np

    assert DualDecoderConfig(repair_drift=np.float32(0.5)).repair_drift == 0.5
    assert type(DualDecoderConfig(repair_drift=1).repair_drift) is float
    assert DualDecoderConfig(repair_drift=2**64).repair_drift == float(2**64)  # compared as float32 later


def test_retrieval_threads_default_to_the_cores_this_process_may_use(monkeypatch):
    import os

    import torch

    from dual_cache.config import DualDecoderConfig, usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert usable_cores() == 3
    config = DualDecoderConfig()
    assert config.threads_for(torch.device("cuda")) == 3  # the affinity, not os.cpu_count()
    assert config.threads_for(torch.device("cpu")) == 0
    assert DualDecoderConfig(retrieval_threads=5).threads_for(torch.device("cuda")) == 5
