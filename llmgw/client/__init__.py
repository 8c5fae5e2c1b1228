"""llmgw.client."""
