import json
import os

import six


def main() -> None:
    print(json.dumps({"greeting": "hello from an installed project", "six": six.__version__,
                      "pip_settings_in_the_image": [k for k in os.environ
                                                    if k.startswith(("PIP_", "UV_"))]}))
