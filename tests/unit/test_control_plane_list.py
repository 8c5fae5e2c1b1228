"""The agent's control plane list: agent.yaml's addresses plus the leader's, kept on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.node.planes import PLANES_FILE, ControlPlaneList


def test_learned_addresses_come_first_and_survive_a_restart(tmp_path: Path) -> None:
    planes = ControlPlaneList(["10.0.0.1:7070"], tmp_path)
    assert planes.addresses() == ["10.0.0.1:7070"]
    planes.learn(["10.0.0.2:7070", "10.0.0.1:7070", "10.0.0.3:7070"])
    assert planes.addresses() == ["10.0.0.2:7070", "10.0.0.1:7070", "10.0.0.3:7070"]
    again = ControlPlaneList(["10.0.0.1:7070", "10.0.0.9:7070"], tmp_path)
    assert again.addresses() == ["10.0.0.2:7070", "10.0.0.1:7070", "10.0.0.3:7070", "10.0.0.9:7070"]


@pytest.mark.parametrize("text", ["{not json", '{"a": 1}', '["ok:1", 3]', '[""]'])
def test_a_damaged_file_is_ignored_with_a_warning(tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / PLANES_FILE).write_text(text)
    assert ControlPlaneList(["10.0.0.1:7070"], tmp_path).addresses() == ["10.0.0.1:7070"]
    assert "ignoring" in caplog.text


@pytest.mark.parametrize("addresses", [["no-port"], [""], ["h:1"] * 65])
def test_a_malformed_list_is_refused_and_changes_nothing(tmp_path: Path, addresses: list[str]) -> None:
    planes = ControlPlaneList(["10.0.0.1:7070"], tmp_path)
    with pytest.raises(ValueError):
        planes.learn(addresses)
    assert planes.addresses() == ["10.0.0.1:7070"] and not (tmp_path / PLANES_FILE).exists()
