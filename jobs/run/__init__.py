"""The run directory on storage: its files and checkpoints, append-only logs, TensorBoard, the run's events and the
goodput ledger computed from them. Never imports ``jobs.driver``, ``jobs.spec`` or the commands
(tests/test_imports.py): the driver and the commands read and write a run through it."""
