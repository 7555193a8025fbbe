"""The coordinator: stores jobs, answers researchers over REST and agents over gRPC."""
