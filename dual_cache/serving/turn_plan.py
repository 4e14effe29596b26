"""What the serving scheduler does in one turn of its loop, decided before any of it runs (`TurnPlan`).

The scheduler plans a turn from its lists of rows (`plan_turn`) and then carries the plan out
(`Scheduler.run_turn`), as vLLM's scheduler hands its model runner one `SchedulerOutput` per step. Planning reads
the rows and their handles and changes nothing: it needs no model, no cache and no lock, so it is tested on rows
alone (tests/test_turn_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .rows import Row


@dataclass(frozen=True)
class BatchPlan:
    """The running batch's part of a turn: which rows join and leave it, and whether it decodes.

    Attributes:
        joining: prefilled rows that join the batch at this turn's regroup, in the order they were prefilled.
        leaving: finished rows that leave the batch at this turn's regroup (empty without one).
        regroup: whether the batch is rebuilt (`batch.regroup`) before its decode step.
        decode: whether the batch runs one decode step (a row is live after the regroup; a regroup that cannot
            carry some rows may leave none live, and then no step runs).
    """

    joining: tuple[Row, ...] = ()
    leaving: tuple[Row, ...] = ()
    regroup: bool = False
    decode: bool = False


@dataclass(frozen=True)
class TurnPlan:
    """One turn of the scheduler's loop, in the order it runs.

    Attributes:
        dropped: admitted rows that have not joined the batch (prefilling, or prefilled and waiting) whose request
            was cancelled: they leave the scheduler first (a prefilled session row's session keeps its cache).
        cancelled: running rows whose request was cancelled: finished now; they leave at a regroup.
        prefill: the oldest prefilling row, fed one prefill chunk this turn; None when no row prefills.
        copy_prefix: the prefill of `prefill` starts now, with a prefix cache: it first copies the longest cached
            prefix its prompt starts with (`PrefixCache.start`).
        batch: the running batch's part, for the rows as they stand once `dropped` left and `cancelled` finished.
            Whether the prefill chunk ends its row's prompt (or the request: its first token can end it, or it
            fails) is known only once it ran: when it moves its row out of the prefilling list, `run_turn` plans
            this part again (`plan_batch`) on the lists as they then stand, so a request whose prefill ends can
            join in the same turn.
    """

    dropped: tuple[Row, ...] = ()
    cancelled: tuple[Row, ...] = ()
    prefill: Row | None = None
    copy_prefix: bool = False
    batch: BatchPlan = BatchPlan()


def plan_turn(prefilling: Sequence[Row], ready: Sequence[Row], running: Sequence[Row],
              prefix_block: int) -> TurnPlan:
    """Plan one turn from the scheduler's lists of rows; changes nothing.

    Args:
        prefilling: admitted rows still prefilling, oldest first. ready: prefilled rows waiting to join the batch.
        running: the running batch's rows (`DualBatch.rows`, finished ones included until they leave).
        prefix_block: the scheduler's prefix-cache block (0: no prefix cache).
    """
    dropped = tuple(row for row in [*prefilling, *ready] if row.handle.cancel_requested)
    cancelled = tuple(row for row in running if row.handle.cancel_requested and not row.done)
    prefilling = [row for row in prefilling if row not in dropped]
    ready = [row for row in ready if row not in dropped]
    prefill = prefilling[0] if prefilling else None
    # its prefill starts now (a request asking for its prompt's logprobs prefills it all)
    copy_prefix = bool(prefix_block) and prefill is not None and prefill.cache is None and prefill.prefilled == 0 \
        and not prefill.wants_prompt_logits
    return TurnPlan(dropped, cancelled, prefill, copy_prefix, plan_batch(running, ready, prefilling, cancelled))


def plan_batch(running: Sequence[Row], ready: Sequence[Row], prefilling: Sequence[Row],
               finishing: Sequence[Row] = ()) -> BatchPlan:
    """Plan the running batch's part of a turn; changes nothing.

    Prefilled requests join together (one regroup) once no other request is prefilling, or the batch has no live
    row, or two are ready. A regroup copies the rows' host K/V, so rows that finished leave when others join, when
    they are half the batch, or at once when a session keeps the sequence; until then a finished row is fed pad
    tokens.

    Args:
        running: the batch's rows. ready: prefilled rows waiting to join. prefilling: rows still prefilling.
        finishing: rows of `running` that finish before the regroup (cancelled this turn): counted as finished.
    """
    finished = [row for row in running if row.done or row in finishing]
    live = len(running) - len(finished)
    joining = tuple(ready) if not prefilling or not live or len(ready) >= 2 else ()
    regroup = bool(joining) or bool(finished) and (2 * len(finished) >= len(running)
                                                   or any(row.session for row in finished))
    return BatchPlan(joining, tuple(finished) if regroup else (), regroup, bool(live or joining))
