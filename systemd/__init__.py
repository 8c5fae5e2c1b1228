"""The systemd units llmgw ships, as package data (``llmgw.systemd``): see llmgw/cli/units.py."""
