"""The site side: the site agent and the SGLang stand-in. The agent starts its reporter process
after its gRPC server runs, so grpc-core's fork handlers are kept off (see core/forks.py)."""

from core.forks import keep_grpc_out_of_forks

keep_grpc_out_of_forks()
