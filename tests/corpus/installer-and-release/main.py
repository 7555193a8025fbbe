import json
import subprocess
from pathlib import Path

tool = subprocess.run(["corpus-tool"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"tool": tool, "weights": Path("/opt/data/weights.txt").read_text().strip()}))
