"""Progress text of weights fetches and installs (llmgw.node.install.artifact, pure functions)."""

from __future__ import annotations

from llmgw.node.install.artifact import fraction_text, human_size


def test_progress_text() -> None:
    assert fraction_text(1_200_000_000, 4_000_000_000) == "1.2/4.0 GB"
    assert fraction_text(512_000, 2_000_000) == "0.5/2.0 MB"
    assert fraction_text(16_000_000, None) == "16 MB"
    assert human_size(16_000_000) == "16 MB"
    assert human_size(4_000_000_000) == "4.0 GB"
