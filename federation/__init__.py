"""inference-federation: one OpenAI-compatible endpoint over GPU sites in many regions."""
