"""llmgw.node."""
