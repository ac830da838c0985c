"""inference-federation: one OpenAI-compatible endpoint over GPU sites in many regions.

This package is the top of the house: the front door (`federation.gateway`, which stands on
`core` alone) and the operator's tools (`cli`, the embedded default, `bench`, `drills`, the
WAN link proxy, admin calls), which may use every layer below.
"""

from core.forks import keep_grpc_out_of_forks

keep_grpc_out_of_forks()  # fedctl starts sites and schedulers after its own gRPC calls
