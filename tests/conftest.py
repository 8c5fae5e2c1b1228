"""Shared pytest setup: the PostgreSQL fixture (tests/pg.py) is available to every test."""

pytest_plugins = ["tests.pg"]
