"""The resident set (`dual_cache/transfer/resident_set.py`): the native plan against its pure-torch reference on random
steps, the delta path against a full copy of what is wanted, and a refused plan that changes nothing."""

import copy

import pytest
import torch

from dual_cache.engine import native as engine_native
from dual_cache.transfer.resident_set import ResidentSet, attended_entries

needs_engine = pytest.mark.skipif(engine_native.library() is None, reason="no C++ compiler for the native engine")


def _step(generator, batch, kv_heads, width, context, step):
    """One step's request: wanted positions (half of them a run that moves one position a step, as the next
    positions of what was attended do, the rest random, duplicates included), validity, and the attended ones."""
    wanted = torch.randint(0, context, (batch, kv_heads, width), generator=generator)
    wanted[..., : width // 2] = torch.arange(width // 2) + step
    valid = torch.rand(batch, kv_heads, width, generator=generator) < 0.9
    wanted[..., -1] = -1  # a negative position marked valid is never wanted (nor a neighbour row's)
    used = torch.randint(0, context, (batch, kv_heads, width // 2), generator=generator)
    used = torch.where(torch.rand(batch, kv_heads, width // 2, generator=generator) < 0.8, used, -1)
    return wanted, valid, used


def _key(plan):
    return sorted(zip(plan.slots.tolist(), plan.positions.tolist(), plan.flat_heads.tolist()))


@needs_engine
@pytest.mark.parametrize("batch,kv_heads,capacity,width,exclusive", [
    (4, 3, 96, 64, False), (2, 2, 40, 24, False), (3, 1, 16, 16, True), (1, 4, 128, 96, False)])
def test_native_plan_equals_the_reference_on_random_steps(batch, kv_heads, capacity, width, exclusive):
    """Every plan (slots, positions, rows), the mirror after it and the counts are the reference's, over 30 steps
    that evict, on the whole batch and on row subsets (a request whose other rows are done)."""
    seed = int(torch.randint(0, 2**31, ()).item())
    generator = torch.Generator().manual_seed(seed)
    native = ResidentSet(batch, kv_heads, capacity, 4, torch.float32, "cpu")
    reference = copy.deepcopy(native)
    for step in range(30):
        wanted, valid, used = _step(generator, batch, kv_heads, width, 600, step)
        rows = None
        if step % 3 == 0 and batch > 1:
            rows = sorted(set(torch.randint(0, batch, (2,), generator=generator).tolist()))
            wanted, valid, used = wanted[rows], valid[rows], used[rows]
        got = native.plan(wanted, valid, rows, used, exclusive, native=True)
        want = reference.plan(wanted, valid, rows, used, exclusive, native=False)
        assert _key(got) == _key(want), f"seed {seed}, step {step}"
        assert (got.wanted, got.resident) == (want.wanted, want.resident), f"seed {seed}, step {step}"
        assert torch.equal(native.host_positions, reference.host_positions), f"seed {seed}, step {step}"
        assert torch.equal(native.stamps, reference.stamps), f"seed {seed}, step {step}"


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=needs_engine), False])
def test_delta_copies_hold_what_a_full_copy_would(use_native):
    """Applying only each plan's delta leaves the device set holding, per (sequence, KV head), exactly the keys and
    values a full copy of its positions would: every wanted valid position is resident, with its own key."""
    seed = int(torch.randint(0, 2**31, ()).item())
    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, capacity, width, context, dim = 2, 3, 48, 32, 300, 8
    keys = torch.randn(batch, kv_heads, context, dim, generator=generator)
    values = torch.randn(batch, kv_heads, context, dim, generator=generator)
    resident = ResidentSet(batch, kv_heads, capacity, dim, torch.float32, "cpu")
    resident.allocate()
    copied = 0
    for step in range(25):
        wanted, valid, used = _step(generator, batch, kv_heads, width, context, step)
        plan = resident.plan(wanted, valid, None, used, native=use_native)
        sequence, head = plan.flat_heads // kv_heads, plan.flat_heads % kv_heads
        resident.apply(plan.slots, plan.positions, keys[sequence, head, plan.positions],
                       values[sequence, head, plan.positions])
        copied += plan.count
        assert torch.equal(resident.positions, resident.host_positions), f"seed {seed}: mirror and device differ"
        positions, present, held_keys = attended_entries(resident.segment())
        for b in range(batch):
            for h in range(kv_heads):
                held = positions[b, h][present[b, h]]
                full = keys[b, h, held]  # what a full copy of these positions would hold
                assert torch.equal(held_keys[b, h][present[b, h]], full), f"seed {seed}, step {step}"
                need = set(wanted[b, h][valid[b, h] & (wanted[b, h] >= 0)].tolist())
                assert need <= set(held.tolist()), f"seed {seed}, step {step}: a wanted entry is not resident"
        slots = resident.positions.view(-1) >= 0
        assert torch.equal(resident.values.view(-1, dim)[slots],
                           values.view(batch * kv_heads, context, dim)[
                               torch.arange(batch * kv_heads).repeat_interleave(capacity)[slots],
                               resident.positions.view(-1)[slots]]), f"seed {seed}"
    assert copied < 25 * batch * kv_heads * width  # the delta is smaller than copying everything wanted each step


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=needs_engine), False])
def test_a_plan_wanting_more_than_the_capacity_is_refused_and_changes_nothing(use_native):
    resident = ResidentSet(2, 2, 8, 4, torch.float32, "cpu")
    resident.plan(torch.arange(6).expand(2, 2, 6), torch.ones(2, 2, 6, dtype=torch.bool), native=use_native)
    before = (resident.host_positions.clone(), resident.stamps.clone(), resident.step)
    with pytest.raises(ValueError, match="raise the resident capacity"):
        resident.plan(torch.arange(100, 110).expand(2, 2, 10), torch.ones(2, 2, 10, dtype=torch.bool),
                      native=use_native)
    assert torch.equal(resident.host_positions, before[0]) and torch.equal(resident.stamps, before[1])
    assert resident.step == before[2]


def test_a_resident_set_needs_a_capacity():
    with pytest.raises(ValueError, match="capacity >= 1"):
        ResidentSet(1, 1, 0, 4, torch.float32, "cpu")


def test_a_short_request_holds_no_slot_that_could_never_fill():
    """A request shorter than `resident_factor × budget` gets at most the positions a step can ever select (its
    tokens minus window and sink) per KV head, not `resident_factor ×` them."""
    from dual_cache import DualDecoderCache
    from tests.conftest import tiny_llama

    model = tiny_llama(seed=8)
    prompt = torch.randint(3, 90, (1, 200), generator=torch.Generator().manual_seed(9))
    with DualDecoderCache(model.config, budget=256) as cache:
        model.generate(prompt, max_new_tokens=4, do_sample=False, cache=cache)
        capacities = {layer.shape.capacity for layer in cache.dual_layers}
    # the request holds 200 + 4 tokens and the last step's speculated one; window 64, sink 4
    assert capacities == {200 + 4 + 1 - 64 - 4}
