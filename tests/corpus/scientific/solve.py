import json

import numpy as np
from scipy import linalg, optimize

a = np.array([[3.0, 1.0], [1.0, 2.0]])
x = linalg.solve(a, np.array([9.0, 8.0]))
root = optimize.brentq(lambda t: t * t - 2, 0, 2)
print(json.dumps({"x": [round(v, 6) for v in x], "sqrt2": round(root, 6),
                  "numpy": np.__version__}))
