"""llmgw's nft table as text, the firewall setting's checks and the control plane's plan
(applied for real, in network namespaces, by tests/system/test_firewall.py)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from llmgw.control.firewall_file import control_plane_plan
from llmgw.nftables import FirewallPlan, check_firewall_setting, read_plan, render, write_plan


def test_a_plan_renders_one_table_replaced_in_one_transaction() -> None:
    plan = FirewallPlan(True, (9000, 8000), (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8")))
    text = render(plan)
    assert text.startswith("table inet llmgw {}\ndelete table inet llmgw\ntable inet llmgw {\n")
    assert "elements = { 8000, 9000 }" in text
    assert "set peers4 { type ipv4_addr; flags interval; auto-merge; elements = { 10.0.0.0/8 } }" in text
    assert "elements = { fd00::/8 }" in text
    assert "tcp dport != @ports accept" in text and text.rstrip().endswith("}")
    assert "meta l4proto tcp reject with tcp reset" in text
    assert "elements" not in render(FirewallPlan(True)).split("chain")[0].split("set peers4")[1]  # empty sets
    assert render(FirewallPlan(False)) == "table inet llmgw {}\ndelete table inet llmgw\n"


def test_the_setting_is_checked_with_the_key_that_is_wrong() -> None:
    assert check_firewall_setting(None) == {"enabled": True, "networks": []}
    assert check_firewall_setting({"networks": ["10.1.0.0/16", "192.168.1.7"]})["networks"] == [
        "10.1.0.0/16", "192.168.1.7"]
    for bad, message in (({"enabled": "yes"}, "firewall.enabled"), ({"networks": "10.0.0.0/8"}, "firewall.networks"),
                         ({"networks": ["10.0.0.0/33"]}, "'10.0.0.0/33' is not an address or network"),
                         ({"ports": [1]}, "firewall.ports: unknown key"), ([], "expected a mapping")):
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            check_firewall_setting(bad)


def test_a_control_plane_restricts_its_ports_only_once_networks_are_listed() -> None:
    assert control_plane_plan(None, [7070], ["10.0.0.2"]) == FirewallPlan(True)  # no networks: nothing restricted
    assert control_plane_plan({"enabled": False, "networks": ["10.0.0.0/8"]}, [7070], []) == FirewallPlan(False)
    plan = control_plane_plan({"networks": ["10.9.0.0/16"]}, [7070, 9100], ["192.168.5.5", "fd00::1"])
    assert plan.ports == (7070, 9100)
    assert {str(p) for p in plan.peers} == {"10.9.0.0/16", "192.168.5.5/32", "fd00::1/128"}


def test_the_plan_file_round_trips_and_is_rewritten_only_on_change(tmp_path: Path) -> None:
    path = tmp_path / "firewall.json"
    plan = FirewallPlan(True, (7070,), (ipaddress.ip_network("10.0.0.0/8"),))
    assert write_plan(path, plan) is True
    assert write_plan(path, plan) is False
    assert read_plan(path) == plan
    path.write_text('{"enabled": true, "ports": [70000]}')
    with pytest.raises(ValueError, match="ports"):
        read_plan(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        read_plan(path)
