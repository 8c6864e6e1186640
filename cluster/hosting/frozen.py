"""Imported last by a rank fork server's preload (multiprocessing's and a warm rank host's take module names): what the
server imported is frozen (``gc.freeze``) before any rank forks, and every rank inherits it so: a rank's full
collections never scan it.

The preload (torch, torch._dynamo, Accelerate, and on a warm host transformers) is most of a rank's objects: a rank of
the bench's MLP tracked 370k, and its one full collection in 400 steps took 0.18 s, a pause on that rank alone that
the others wait out at the next collective (#58). Frozen, its pages are not written by those collections either (the
ranks share them with the server, copy-on-write). Nothing is collected first: the few cycles the imports left stay.
"""

import gc

gc.freeze()
