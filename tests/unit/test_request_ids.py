"""Request ids (llmgw.router.http.request_id): kept when acceptable, otherwise fresh and unique, also across a fork."""

from __future__ import annotations

import os
import re

from llmgw.router.http.request_id import new_request_id, request_id_from

HEX32 = re.compile(r"[0-9a-f]{32}")


def test_fresh_ids_look_like_uuid4_hex_and_do_not_repeat() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert all(HEX32.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_client_id_is_kept_only_if_it_looks_like_an_id() -> None:
    assert request_id_from("req-1.a:b/c+d=e") == "req-1.a:b/c+d=e"
    for bad in (None, "", "has space", "x" * 129, "new\nline"):
        fresh = request_id_from(bad)
        assert HEX32.fullmatch(fresh), bad


def test_a_forked_process_does_not_repeat_its_parents_ids() -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id and leave at once
        try:
            os.write(write_end, new_request_id().encode())
        finally:
            os._exit(0)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    parent_id = new_request_id()
    assert HEX32.fullmatch(child_id)
    assert child_id[:16] != parent_id[:16]
