"""llmgw.control."""
