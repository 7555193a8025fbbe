"""The same question asked of jq (from apt) and of jmespath (from pip)."""
import json
import subprocess

import jmespath

runs = {"runs": [{"lr": 0.1, "loss": 0.9}, {"lr": 0.01, "loss": 0.4}, {"lr": 0.001, "loss": 0.6}]}
by_jq = subprocess.run(["jq", "-c", "[.runs[] | select(.loss < 0.7) | .lr]"],
                       input=json.dumps(runs), capture_output=True, text=True, check=True)
print(json.dumps({"jq": json.loads(by_jq.stdout),
                  "jmespath": jmespath.search("runs[?loss < `0.7`].lr", runs),
                  "jq_version": subprocess.run(["jq", "--version"], capture_output=True,
                                               text=True).stdout.strip()}))
