"""The bottom of the package: generic dtype and matmul helpers, the one randomness policy and the
one atomic file write. Its modules import nothing else from private_engine, so every other
stage may build on them."""
