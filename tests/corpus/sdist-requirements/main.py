import json

import docopt
import six

print(json.dumps({"docopt": docopt.__version__, "six_major": six.__version__.split(".")[0]}))
