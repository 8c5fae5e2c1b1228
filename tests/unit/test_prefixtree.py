"""PrefixTree and the prompt text it keys requests by."""

from __future__ import annotations

from llmgw.router.prefixtree import (
    GROW_NODES, MIN_NODES_PER_REPLICA, SHRINK_FACTOR, PrefixTree, path_hashes, prompt_text,
)


def test_prompt_text_chat_grows_with_the_conversation() -> None:
    first = prompt_text({"messages": [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "hi"}]})
    second = prompt_text({"messages": [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "yo"}]})
    assert second.startswith(first)
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({}) == ""
    parts = prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    assert '"text":"x"' in parts


def test_path_hashes_share_prefix_and_salt_separates() -> None:
    a = path_hashes("x" * 256 + "a" * 128, chunk=128)
    b = path_hashes("x" * 256 + "b" * 128, chunk=128)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert path_hashes("x" * 127, chunk=128) == []
    assert path_hashes("x" * 256, salt="t1", chunk=128)[0] != path_hashes("x" * 256, salt="t2", chunk=128)[0]


def test_match_and_lru_eviction_keeps_roots() -> None:
    tree = PrefixTree(max_nodes_per_replica=4)
    shared = path_hashes("s" * 256 + "one" * 100, chunk=128)  # 4 nodes
    tree.insert("r", shared)
    assert tree.match("r", shared) == 4 and tree.match("other", shared) == 0
    second = path_hashes("s" * 256 + "two" * 50, chunk=128)  # shares 2 nodes, adds 1
    tree.insert("r", second)
    assert tree.size("r") == 4
    assert tree.match("r", second) == 3  # the new path is whole
    assert tree.match("r", shared) == 3  # the old path lost its deepest node, not its root
    tree.forget("r")
    assert tree.size() == 0


def test_the_bound_learns_the_engines_cache_from_what_it_reports() -> None:
    tree = PrefixTree(max_nodes_per_replica=1000)
    paths = [path_hashes(f"{i:03d}" * 200, chunk=128) for i in range(40)]  # 4 nodes each
    for path in paths:
        tree.insert("r", path)
    assert tree.size("r") == 160 and tree.bound("r") == 1000
    window = tree.window("r")
    tree.engine_held("r", window, claimed=128.0, held=120)  # borne out, the tree below its bound: no change
    assert tree.bound("r") == 1000
    tree.engine_held("r", window, claimed=128.0, held=100)  # short by less than two nodes' worth: noise
    assert tree.bound("r") == 1000
    # The engine held nothing of what the tree claimed: its cache is smaller than the tree.
    tree.engine_held("r", window, claimed=128.0, held=0)
    assert tree.bound("r") == tree.size("r") == int(160 * SHRINK_FACTOR)
    assert tree.match("r", paths[-1]) == 4 and tree.match("r", paths[0]) == 0  # the oldest went first
    # Another claim made before that shrink counts no more: one shrink per window.
    tree.engine_held("r", window, claimed=128.0, held=0)
    assert tree.bound("r") == int(160 * SHRINK_FACTOR)
    for _ in range(10):  # claims made since keep shrinking it, down to the floor
        tree.engine_held("r", tree.window("r"), claimed=128.0, held=0)
    assert tree.bound("r") == tree.size("r") == MIN_NODES_PER_REPLICA
    # A claim borne out while the tree is full lets the bound grow, a little each time.
    tree.engine_held("r", tree.window("r"), claimed=128.0, held=128)
    assert tree.bound("r") == MIN_NODES_PER_REPLICA + GROW_NODES
    tree.insert("r", path_hashes("new" * 400, chunk=128))
    assert tree.size("r") == MIN_NODES_PER_REPLICA + GROW_NODES
    assert tree.bound("other") == 1000  # per replica
    tree.forget("r")
    assert tree.bound("r") == 1000 and tree.window("r") == 0
