import json
import subprocess

import tally

git = subprocess.run(["git", "--version"], capture_output=True, text=True).stdout.split()[:2]
print(json.dumps({"tally": tally.count([1, 2, 3]), "git": " ".join(git)}))
