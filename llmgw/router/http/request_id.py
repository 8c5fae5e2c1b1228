"""Request ids: the one rule for the ``x-request-id`` every gateway response carries.

A client-supplied id is kept if it looks like an id (it ends up in logs and upstream
headers), otherwise a fresh one is generated. Both the forwarded POSTs and the requests
Quart serves get theirs from :func:`request_id_from`, called once per request by
:class:`~llmgw.router.http.forward.FastForward`.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets

# What a client may send as its request id: printable, no spaces, at most 128 characters.
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


def request_id_from(given: str | None) -> str:
    """Return ``given`` if it is an acceptable request id, else a fresh one (:func:`new_request_id`)."""
    return given if given and REQUEST_ID_RE.fullmatch(given) else new_request_id()


def _new_id_prefix() -> None:
    global _id_prefix
    _id_prefix = secrets.token_hex(8)


_id_prefix = ""
_new_id_prefix()
os.register_at_fork(after_in_child=_new_id_prefix)  # a forked gateway worker must not repeat its parent's ids
_id_counter = itertools.count(1)


def new_request_id() -> str:
    """Return a fresh request id: 32 hex digits, as ``uuid4().hex`` gives.

    A random 64-bit prefix per process and a 64-bit counter: unique without a
    ``getrandom`` syscall per request, which ``uuid4`` makes (about 2% of the gateway's
    CPU per request). Request ids name requests in logs and traces; they are not secrets.
    """
    return f"{_id_prefix}{next(_id_counter):016x}"
