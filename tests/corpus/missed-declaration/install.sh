pip install --no-cache-dir idna==3.7
