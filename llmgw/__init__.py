"""llmgw: a cluster manager and OpenAI-compatible gateway for LLM inference on your own machines."""

__version__ = "0.1.0"
