"""Helpers for tests and demos (tiny models); nothing here is used to serve real traffic."""
