"""The gateway: the federation's one OpenAI-compatible endpoint."""
