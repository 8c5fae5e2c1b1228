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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test its xdist group: a module's tests stay together (its module-scoped
    fixtures are made once), and :data:`HOST_SERIAL` is one group. Without xdist the marks
    change nothing.

    First among the hooks: xdist's worker reads the marks in its own implementation of this
    hook (it tags each test's id with its group, which the ``loadgroup`` scheduler splits the
    work by). pytest 9.2 broke that tagging (pyproject.toml pins pytest below it)."""
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        group = "host-serial" if module.startswith(HOST_SERIAL) else module
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown (and never called) without xdist
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Under ``--dist loadgroup``, stop the run when a worker's tests came back without their
    xdist_group in their ids: the grouping above would be lost without a word."""
    config = node.config  # type: ignore[attr-defined]
    if config.getvalue("dist") == "loadgroup" and ids and "@" not in ids[0]:
        pytest.exit(
            f"pytest-xdist did not tag the tests with their xdist_group (pytest {pytest.__version__}): "
            "--dist loadgroup would spread each group over the workers (pytest-dev/pytest-xdist#1386); "
            "install the pytest that pyproject.toml's test extra names",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
