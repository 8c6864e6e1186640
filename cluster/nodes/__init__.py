"""Ray's side of a run: connecting to a cluster, reserving one bundle per node, the node actors and the group that
drives them, the working directory's upload. Imports Ray; never torch, Accelerate, ``cluster.rank`` or
``cluster.checkpoint`` (tests/test_imports.py)."""
