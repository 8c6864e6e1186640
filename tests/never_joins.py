"""A training module whose import never finishes on rank 1: that rank never joins the group."""

import os
import time

if os.environ.get("RANK") == "1":
    time.sleep(3600)


def train(config: dict) -> None:
    from accelerate import Accelerator

    Accelerator()
