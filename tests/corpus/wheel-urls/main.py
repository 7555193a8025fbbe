import json

import tinyops
import tinyvec

print(json.dumps({"tinyops": tinyops.double(21), "tinyvec": tinyvec.NAME}))
