"""inference-federation: one OpenAI-compatible endpoint over GPU sites in many regions.

This package is the top of the house: the front door (`federation.gateway`, which stands on
`core` alone) and the operator's tools (`cli`, the embedded default, `bench`, `drills`, the
WAN link proxy, admin calls), which may use every layer below.
"""
