"""distributed.together, the barrier that carries each rank's failure, played from one rank against scripted others."""
from __future__ import annotations

import pickle
from typing import Any, Callable

import pytest

from cossd.trainer.distributed import Ranks, RanksFailedError, together


class Scripted(Ranks):
    """Rank `rank` of a job whose other ranks' outcomes are given: gather puts this rank's own
    in its place, and counts the exchanges."""

    def __init__(self, rank: int, others: dict[int, dict[str, Any]]) -> None:
        super().__init__(rank, len(others) + 1, None)
        object.__setattr__(self, "others", others)  # a frozen dataclass
        object.__setattr__(self, "exchanges", [])

    def gather(self, value: Any) -> list[Any]:
        self.exchanges.append(value)  # type: ignore[attr-defined]
        return [value if rank == self.rank else self.others[rank] for rank in range(self.world)]  # type: ignore[attr-defined]


def fails(exc: BaseException) -> Callable[[], int]:
    def work() -> int:
        raise exc
    return work


def ok() -> int:
    return 7


def failed(text: str, knock_on: bool = False) -> dict[str, Any]:
    return {"error": text, "knock_on": knock_on}


def test_every_rank_done_gives_every_rank_result_in_rank_order() -> None:
    assert together(Scripted(1, {0: {"value": 5}, 2: {"value": 9}}), ok, "x") == [5, 7, 9]


def test_another_ranks_failure_is_raised_here_naming_it() -> None:
    ranks = Scripted(0, {1: failed("OSError: [Errno 5] injected")})
    with pytest.raises(RanksFailedError) as raised:
        together(ranks, ok, "cossd: doing it")
    assert str(raised.value) == "cossd: doing it: rank 1: OSError: [Errno 5] injected"
    assert raised.value.failures == [(1, "OSError: [Errno 5] injected")]


def test_a_failing_rank_still_takes_part_and_raises_every_ranks_failure_chained_from_its_own() -> None:
    ranks = Scripted(1, {0: {"value": 1}})
    own = ValueError("bad layout")
    with pytest.raises(RanksFailedError) as raised:
        together(ranks, fails(own), "cossd: opening")
    assert raised.value.__cause__ is own and raised.value.failures == [(1, "ValueError: bad layout")]
    assert ranks.exchanges == [failed("ValueError: bad layout")]  # type: ignore[attr-defined]


def test_reraise_own_keeps_this_ranks_error_its_own_type() -> None:
    own = ValueError("bad layout")
    with pytest.raises(ValueError) as raised:
        together(Scripted(1, {0: {"value": 1}}), fails(own), "cossd: opening", reraise_own=True)
    assert raised.value is own
    # The other ranks name it.
    with pytest.raises(RanksFailedError, match="cossd: opening: rank 1: ValueError: bad layout"):
        together(Scripted(0, {1: failed("ValueError: bad layout")}), ok, "cossd: opening", reraise_own=True)


def test_a_rank_that_failed_only_because_another_did_is_not_listed() -> None:
    inner = RanksFailedError("inner", [(1, "OSError: x")])
    ranks = Scripted(0, {1: failed("OSError: x")})
    with pytest.raises(RanksFailedError) as raised:
        together(ranks, fails(inner), "outer", reraise_own=True)  # a knock-on is never re-raised as own
    assert raised.value.failures == [(1, "OSError: x")]
    assert ranks.exchanges == [failed("RanksFailedError: inner: rank 1: OSError: x", knock_on=True)]  # type: ignore[attr-defined]
    # Where every failure is a knock-on, they are all listed.
    with pytest.raises(RanksFailedError) as every:
        together(Scripted(0, {1: failed("RanksFailedError: y", knock_on=True)}), ok, "outer")
    assert every.value.failures == [(1, "RanksFailedError: y")]


def test_an_interrupt_stays_one_here_after_the_others_are_told() -> None:
    ranks = Scripted(1, {0: {"value": 1}})
    with pytest.raises(KeyboardInterrupt):
        together(ranks, fails(KeyboardInterrupt()), "x")
    assert ranks.exchanges == [failed("KeyboardInterrupt: ")]  # type: ignore[attr-defined]


def test_ranks_failed_error_pickles() -> None:
    error = pickle.loads(pickle.dumps(RanksFailedError("doing", [(1, "OSError: x")])))
    assert str(error) == "doing: rank 1: OSError: x" and error.failures == [(1, "OSError: x")]
