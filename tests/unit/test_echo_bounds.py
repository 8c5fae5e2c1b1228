"""Values a client sent are quoted back in errors only up to a bound (a 1 MB model name came back whole)."""

from __future__ import annotations

from typing import Callable

import pytest

from llmgw.router import errors
from llmgw.router.adapters import checked_lora_scales
from llmgw.router.auth import Tenant, model_not_allowed
from llmgw.router.errors import MAX_ECHO_CHARS, MAX_MESSAGE_CHARS, GatewayError, echo

HUGE = "x" * 1_000_000
CUT = "x" * (MAX_ECHO_CHARS - 3) + "..."


@pytest.mark.parametrize(
    ("value", "quoted"),
    [("short", "short"), ("x" * MAX_ECHO_CHARS, "x" * MAX_ECHO_CHARS), (HUGE, CUT), (7, "7"),
     ({"id": HUGE}, "{'id': '" + "x" * (MAX_ECHO_CHARS - 11) + "...")],
)
def test_echo_cuts_long_values(value: object, quoted: str) -> None:
    assert echo(value) == quoted and len(echo(value)) <= MAX_ECHO_CHARS


@pytest.mark.parametrize(
    "make",
    [lambda: errors.model_not_found(HUGE), lambda: model_not_allowed("narrow", HUGE)],
    ids=["model_not_found", "model_not_allowed"],
)
def test_model_errors_quote_a_bounded_name(make: Callable[[], GatewayError]) -> None:
    message = make().message
    assert CUT in message and HUGE[: MAX_ECHO_CHARS + 1] not in message


@pytest.mark.parametrize(
    "lora", [[{"id": HUGE}], [{"id": 0, "scale": HUGE}]], ids=["bad id", "bad scale"],
)
def test_lora_entries_are_quoted_bounded(lora: object) -> None:
    with pytest.raises(GatewayError) as err:
        checked_lora_scales(lora, ["a1"], Tenant("t"))
    assert err.value.status == 400 and len(err.value.message) < MAX_ECHO_CHARS + 300


def test_every_message_is_bounded() -> None:
    error = errors.upstream_failed("m", HUGE)
    assert len(error.message) == MAX_MESSAGE_CHARS and error.message.endswith("...")
    assert len(str(error)) < MAX_MESSAGE_CHARS + 100
