"""Prints what `uv sync` installed: the lock's versions (jmespath is locked below its newest)."""

import json
from importlib.metadata import version


def main() -> None:
    import jmespath
    print(json.dumps({"jmespath": version("jmespath"), "six": version("six"),
                      "query": jmespath.search("a.b", {"a": {"b": 7}})}))
