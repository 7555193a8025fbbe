import json
import subprocess

print(json.dumps({"c": subprocess.run(["hello-c"], capture_output=True, text=True).stdout.strip()}))
