"""The serving scheduler's turn plan (`serving/turn_plan.py`), decided from rows alone: no model, no cache, no thread.

Rows are real `Row`s of real `RequestHandle`s (a request is finished with `handle.finish`, cancelled with
`cancel_requested`); sessions are real `Session`s. The scheduler runs these plans in every serving test.
"""

import random

import torch

from dual_cache.serving.requests import GenerationOptions, RequestHandle
from dual_cache.serving.rows import Row
from dual_cache.serving.sessions import Session
from dual_cache.serving.turn_plan import BatchPlan, TurnPlan, plan_batch, plan_turn


def make_row(finished: bool = False, cancelled: bool = False, session: bool = False, prefilled: int = 0,
             prompt_logprobs: int | None = None) -> Row:
    options = GenerationOptions(max_tokens=4, temperature=0, prompt_logprobs=prompt_logprobs)
    handle = RequestHandle(torch.tensor([1, 2, 3]), options, "chat" if session else None)
    row = Row(handle, Session("chat") if session else None, prefilled=prefilled)
    if finished:
        handle.finish("length")
    handle.cancel_requested = cancelled
    return row


def test_an_idle_scheduler_plans_nothing():
    assert plan_turn([], [], [], prefix_block=0) == TurnPlan()
    assert TurnPlan().batch == BatchPlan(joining=(), leaving=(), regroup=False, decode=False)


def test_the_oldest_prefilling_row_gets_the_chunk_and_copies_a_prefix_only_when_its_prefill_starts():
    first, second = make_row(), make_row()
    plan = plan_turn([first, second], [], [], prefix_block=16)
    assert plan.prefill is first and plan.copy_prefix
    assert not plan_turn([first, second], [], [], prefix_block=0).copy_prefix  # no prefix cache
    assert not plan_turn([make_row(prefilled=16)], [], [], prefix_block=16).copy_prefix  # its prefill is under way
    assert not plan_turn([make_row(prompt_logprobs=1)], [], [], prefix_block=16).copy_prefix  # prefills it all


def test_cancelled_rows_are_dropped_before_joining_and_finished_while_running():
    waiting, prefilling, ready = make_row(cancelled=True), make_row(), make_row(cancelled=True)
    running = [make_row(cancelled=True), make_row(), make_row()]
    plan = plan_turn([waiting, prefilling], [ready], running, prefix_block=0)
    assert plan.dropped == (waiting, ready)
    assert plan.cancelled == (running[0],)
    assert plan.prefill is prefilling  # the cancelled row before it no longer prefills
    # the cancelled running row counts as finished: one of three, no session, nothing joins: no regroup yet
    assert plan.batch == BatchPlan(regroup=False, decode=True)
    assert not running[0].done  # planning changes nothing


def test_ready_rows_wait_for_the_prefilling_one_unless_the_batch_is_idle_or_two_are_ready():
    running, prefilling = [make_row()], [make_row(prefilled=8)]
    one, two = make_row(), make_row()
    assert plan_batch(running, [one], prefilling) == BatchPlan(decode=True)  # waits for the other prefill
    assert plan_batch(running, [one], []) == BatchPlan(joining=(one,), regroup=True, decode=True)
    assert plan_batch(running, [one, two], prefilling).joining == (one, two)  # two ready: they join together
    assert plan_batch([make_row(finished=True)], [one], prefilling).joining == (one,)  # no live row
    assert plan_batch([], [one], prefilling) == BatchPlan(joining=(one,), regroup=True, decode=True)


def test_finished_rows_leave_at_half_the_batch_with_a_session_or_when_others_join():
    live = [make_row() for _ in range(3)]
    done = make_row(finished=True)
    assert plan_batch([done, *live], [], []) == BatchPlan(decode=True)  # one of four: fed pads for now
    half = [done, make_row(finished=True), *live[:2]]
    assert plan_batch(half, [], []) == BatchPlan(leaving=tuple(half[:2]), regroup=True, decode=True)
    kept = make_row(finished=True, session=True)
    assert plan_batch([kept, *live], [], []).leaving == (kept,)  # its session keeps the sequence at once
    joining = make_row()
    assert plan_batch([done, *live], [joining], []) == BatchPlan(joining=(joining,), leaving=(done,), regroup=True,
                                                                 decode=True)
    assert plan_batch([done], [], []) == BatchPlan(leaving=(done,), regroup=True, decode=False)  # nothing decodes


def test_random_plans_follow_the_rules_and_change_nothing():
    rng = random.Random(5501)
    for _ in range(300):
        prefilling = [make_row(cancelled=rng.random() < 0.2, prefilled=rng.choice([0, 8]))
                      for _ in range(rng.randint(0, 3))]
        ready = [make_row(cancelled=rng.random() < 0.2) for _ in range(rng.randint(0, 3))]
        running = [make_row(finished=rng.random() < 0.3, cancelled=rng.random() < 0.2, session=rng.random() < 0.2)
                   for _ in range(rng.randint(0, 6))]
        before = [(r.done, r.handle.cancel_requested) for r in prefilling + ready + running]
        plan = plan_turn(prefilling, ready, running, prefix_block=rng.choice([0, 16]))
        assert [(r.done, r.handle.cancel_requested) for r in prefilling + ready + running] == before
        waiting = [r for r in prefilling if not r.handle.cancel_requested]
        assert plan.prefill is (waiting[0] if waiting else None)
        assert set(plan.dropped) == {r for r in prefilling + ready if r.handle.cancel_requested}
        finished = [r for r in running if r.done or r.handle.cancel_requested]
        batch = plan.batch
        assert set(batch.joining) <= set(ready) - set(plan.dropped)
        assert batch.leaving == (tuple(finished) if batch.regroup else ())
        assert batch.regroup == (bool(batch.joining) or (bool(finished) and (
            2 * len(finished) >= len(running) or any(r.session for r in finished))))
        assert batch.decode == (len(finished) < len(running) or bool(batch.joining))
