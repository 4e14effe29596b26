"""The cluster-ranking analysis (`eval/cluster_ranking.py`): its `summary` ranking is the index's own selection."""

import pytest
import torch

from dual_cache import DualDecoderConfig
from dual_cache.eval import cluster_ranking
from dual_cache.host_store import HostKVStore
from dual_cache.retrieval import group_attention_mass
from dual_cache.selectors import Candidates
from dual_cache.selectors.clusters import ClusterSelector

OPTIONS = {"cluster_size": 4, "cluster_segment": 32}


@pytest.mark.parametrize("seed", [31, 32])
def test_summary_ranking_recalls_what_the_index_selects_and_every_cluster_gives_the_exact_selection(seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, 600, 16, generator=g)
    queries = torch.randn(1, 4, 3, 16, generator=g)
    found = cluster_ranking.ranking_recalls(queries, keys, 0.25, 8, [2, 100], window=16, **OPTIONS)
    assert set(found) == {(r, f) for r in cluster_ranking.RANKINGS for f in (2, 100)}
    for ranking in cluster_ranking.RANKINGS:  # a shortlist of every cluster: the exact top-k
        assert torch.allclose(found[ranking, 100], torch.ones(6))
    store = HostKVStore(1, 2, 16, torch.float32, chunk_tokens=4096)
    store.append(keys, keys)
    index = ClusterSelector(DualDecoderConfig(selector="clusters", cluster_min_context=0, cluster_factor=2,
                                              **OPTIONS), 8, store, "cpu")
    for j in range(3):
        hi = 600 - 3 + j - 16
        mask = torch.arange(hi)[None, :] >= 4
        indices, valid = index.select(queries[:, :, j], Candidates(mask, torch.zeros(1, dtype=torch.long)), 0.25)
        mass = group_attention_mass(queries[:, :, j], store.key_chunks(hi), mask, 0.25)
        recall = (torch.gather(mass, 2, indices) * valid).sum(-1) / torch.topk(mass, 8, dim=-1).values.sum(-1)
        assert torch.allclose(recall[0], found["summary", 2][2 * j : 2 * j + 2])
    assert found["summary", 2].min() < 1  # (the test's keys leave something to rank)


def test_two_bit_keys_round_each_channel_to_the_nearest_gaussian_level_of_its_cluster():
    g = torch.Generator().manual_seed(33)
    keys = torch.randn(2, 3, 4, 5, generator=g) * 3 + 1  # (heads, clusters, size, D)
    means, variances = torch.randn(2, 3, 5, generator=g), torch.rand(2, 3, 5, generator=g) + 0.1
    found = cluster_ranking.two_bit_keys(keys, means, variances)
    inner, outer = cluster_ranking.TWO_BIT_LEVELS
    levels = [-outer, -inner, inner, outer]
    for h, c, m, d in torch.cartesian_prod(*(torch.arange(n) for n in keys.shape)).tolist():
        sigma = float(variances[h, c, d]) ** 0.5
        z = (float(keys[h, c, m, d]) - float(means[h, c, d])) / sigma
        nearest = min(levels, key=lambda level: abs(z - level))
        assert found[h, c, m, d].item() == pytest.approx(float(means[h, c, d]) + nearest * sigma, rel=1e-5, abs=1e-5)


def test_bad_arguments_exit_2_before_loading_a_model(capsys):
    assert cluster_ranking.main(["--factors", "0"]) == 2
    assert "--factors" in capsys.readouterr().err
    for options in ('{"cluster_factor": 4}', '{"cluster_size": 3}'):
        assert cluster_ranking.main(["--options", options]) == 2
        assert "--options" in capsys.readouterr().err
