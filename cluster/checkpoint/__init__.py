"""A rank's checkpoints: staged and committed saves, the snapshot a background save writes from, the writer
process, a checkpoint brought to the node and what a resume puts back. Never imports Ray or the rest of
``cluster``'s folders (tests/test_imports.py): the rank side uses it, not the other way round."""
