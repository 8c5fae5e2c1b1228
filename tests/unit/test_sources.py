"""parse_source of llmgw.catalog.sources: what a weights source names (pure functions)."""

from __future__ import annotations

import pytest

from llmgw.catalog.sources import SourceError, is_remote, parse_source


def test_hf_scheme_with_and_without_revision() -> None:
    assert parse_source("hf://org/repo").kind == "hf"
    assert parse_source("hf://org/repo").location == "org/repo"
    assert parse_source("hf://org/repo").revision == "main"
    assert parse_source("hf://org/repo@v1.0").revision == "v1.0"


def test_repository_page_urls_read_as_repository_ids() -> None:
    page = parse_source("https://huggingface.co/Qwen/Qwen2-0.5B")
    assert (page.kind, page.location, page.revision) == ("hf", "Qwen/Qwen2-0.5B", "main")
    tree = parse_source("https://huggingface.co/Qwen/Qwen2-0.5B/tree/abc123")
    assert (tree.kind, tree.location, tree.revision) == ("hf", "Qwen/Qwen2-0.5B", "abc123")
    mirror = parse_source("http://127.0.0.1:9/org/repo", hf_endpoint="http://127.0.0.1:9")
    assert (mirror.kind, mirror.location) == ("hf", "org/repo")


def test_file_urls_stay_urls_and_carry_their_checksum() -> None:
    resolved = parse_source("https://huggingface.co/org/repo/resolve/main/model.gguf")
    assert resolved.kind == "url"
    digest = "ab" * 32
    plain = parse_source(f"https://example.com/m/model.gguf#sha256={digest}")
    assert (plain.kind, plain.location, plain.sha256) == ("url", "https://example.com/m/model.gguf", digest)
    with pytest.raises(SourceError, match="64 hex digits"):
        parse_source("https://example.com/model.gguf#sha256=xyz")


def test_local_paths() -> None:
    assert parse_source("/models/x.gguf").kind == "local"
    assert parse_source("file:///models/x%20y.gguf").location == "/models/x y.gguf"
    assert not is_remote("/models/x.gguf")
    assert is_remote("hf://a/b") and is_remote("https://x/y")


def test_bad_repository_ids_are_refused_with_the_expected_form() -> None:
    with pytest.raises(SourceError, match=r"hf://org/repo\[@revision\]"):
        parse_source("hf://../etc")
    with pytest.raises(SourceError, match="no weights source"):
        parse_source("  ")
