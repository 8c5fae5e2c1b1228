"""Shared pytest setup: the PostgreSQL fixture (tests/pg.py) is available to every test, and
the grouping that lets ``make test`` run the suite on several workers (pytest-xdist)."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.pg"]

#: Tests run one after another on one worker (``--dist loadgroup``), beside the other
#: worker's tests: the engines (vLLM and the trainer take every core: two at once would
#: starve each other past their deadlines) and the tests that create or use the engines'
#: system user (one per host).
HOST_SERIAL = (
    "tests/engines/",
    "tests/system/test_least_privilege.py",
    "tests/unit/test_engine_user.py",
    "tests/unit/test_install_as_user.py",
    "tests/unit/test_doctor.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test its xdist group: a module's tests stay together (its module-scoped
    fixtures are made once), and :data:`HOST_SERIAL` is one group. Without xdist the marks
    change nothing."""
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        group = "host-serial" if module.startswith(HOST_SERIAL) else module
        item.add_marker(pytest.mark.xdist_group(group))
