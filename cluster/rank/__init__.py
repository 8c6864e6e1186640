"""Inside one training process: the worker entry point, the session (``cluster.runtime``'s), scripts run as
functions, the strategy and precision Accelerate is given, pace measurement. Never imports Ray, ``cluster.nodes`` or
``cluster.hosting`` (tests/test_imports.py)."""
