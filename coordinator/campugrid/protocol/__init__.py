"""The contract between campugrid's parts: job states, the job spec, errors and the gRPC messages.

A leaf package: it imports nothing else of campugrid, so the agent, the coordinator and the
command line can all depend on it without depending on each other.
"""
