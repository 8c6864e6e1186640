"""The driver of one run: attempts and their polls, routing what the ranks report, the restart rule, what a run
did written down, nodes reserved before ranks start, what a hang looks like, pace verdicts. Never imports torch or
Accelerate (tests/test_imports.py)."""
