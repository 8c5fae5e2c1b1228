"""The request fields the simulated engine checks the way vLLM does, before it serves anything.

vLLM reads a request with pydantic (lax: ``"0.5"`` is a number, ``"true"`` a boolean) and
then checks its sampling parameters' ranges (``SamplingParams._verify_args``); either
failure is a 400 ``BadRequestError`` naming the field. :func:`check_sampling` does both for
the common fields and returns the request's ``stream`` flag. Values quoted back are
bounded (:func:`llmgw.sim.echo.echo`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from llmgw.sim.echo import echo
from llmgw.sim.engine import EngineError

__all__ = ["check_sampling"]

#: The strings pydantic's lax mode reads as booleans.
_TRUE = frozenset({"true", "yes", "on", "1", "t", "y"})
_FALSE = frozenset({"false", "no", "off", "0", "f", "n"})


def _shown(value: object) -> str:
    return echo(repr(value))


def _refuse(field: str, message: str) -> EngineError:
    """Returns the 400 for ``field``; ``message`` follows the field's name (as vLLM words it)."""
    return EngineError(400, f"{field}{message}", param=field)


def _number(field: str, value: object) -> float:
    """Returns ``value`` as pydantic reads a float (numbers, booleans and numeric strings), if
    finite; raises EngineError(400)."""
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _refuse(
                field, f": Input should be a valid number, unable to parse string as a number, got {_shown(value)}"
            ) from None
    else:
        raise _refuse(field, f": Input should be a valid number, got {_shown(value)}")
    if not math.isfinite(number):
        raise _refuse(field, f": Input should be a finite number, got {_shown(value)}")
    return number


def _integer(field: str, value: object) -> int:
    """Returns ``value`` as pydantic reads an int (integers, booleans, integral floats and
    strings); raises EngineError(400)."""
    if isinstance(value, int):
        return int(value)
    number = _number(field, value) if isinstance(value, (float, str)) else None
    if number is None or not number.is_integer():
        raise _refuse(field, f": Input should be a valid integer, got {_shown(value)}")
    return int(number)


def _boolean(field: str, value: object) -> bool:
    """Returns ``value`` as pydantic reads a bool; raises EngineError(400)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise _refuse(field, f": Input should be a valid boolean, got {_shown(value)}")


#: (field, read, the range vLLM accepts, how vLLM words a value outside it).
_RANGES: tuple[tuple[str, Callable[[str, object], float], Callable[[float], bool], str], ...] = (
    ("temperature", _number, lambda v: v >= 0, "must be non-negative"),
    ("top_p", _number, lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("top_k", _integer, lambda v: v == -1 or v >= 0, "must be 0 or -1 (disable), or at least 1"),
    ("min_p", _number, lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    ("presence_penalty", _number, lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
    ("frequency_penalty", _number, lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
    ("repetition_penalty", _number, lambda v: v > 0, "must be greater than zero"),
    ("n", _integer, lambda v: v >= 1, "must be at least 1"),
    ("max_tokens", _integer, lambda v: v >= 1, "must be at least 1"),
    ("max_completion_tokens", _integer, lambda v: v >= 1, "must be at least 1"),
    ("seed", _integer, lambda v: True, ""),
)


def check_sampling(body: Mapping[str, Any]) -> bool:
    """Returns the request's ``stream`` flag once its sampling fields pass vLLM's checks.

    Absent and null fields take vLLM's defaults. Raises EngineError(400) naming the first
    field of the wrong type or outside its range (``stop``, ``messages`` and the token
    limit against the context are checked where they are used).
    """
    for field, read, accepts, words in _RANGES:
        value = body.get(field)
        if value is not None and not accepts(read(field, value)):
            raise _refuse(field, f" {words}, got {_shown(value)}.")
    stream = body.get("stream")
    return False if stream is None else _boolean("stream", stream)
