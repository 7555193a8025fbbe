"""gRPC metadata names shared by the agent and the coordinator."""

MACHINE_HEADER = "x-campugrid-machine"
SECRET_HEADER = "x-campugrid-secret"  # noqa: S105 - a header name, not a secret
