"""The processes on a node: the rank fork server and the warm rank hosts it may be, starting, watching and reaping
ranks, tailing their output. Runs outside Ray as well as in a node actor: never imports Ray or ``cluster.nodes``
(tests/test_imports.py)."""
