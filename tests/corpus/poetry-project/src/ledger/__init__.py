import json

import jmespath
import six


def main() -> None:
    data = {"entries": [{"amount": 3}, {"amount": 4}]}
    print(json.dumps({"total": sum(jmespath.search("entries[].amount", data)),
                      "six": six.__version__.split(".")[0]}))
