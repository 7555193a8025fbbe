"""The agent's commands, which the `campugrid` command mounts by name (the
`campugrid.commands` entry points in pyproject.toml): `agent` (run, join: `run`) and
`provider` (the machine's owner: install, status, pause...: `provider`, `install`)."""

from campugrid.agent.commands.provider import provider_app
from campugrid.agent.commands.run import agent_app

__all__ = ["agent_app", "provider_app"]
