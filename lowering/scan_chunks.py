"""The chunk loop's step, read by its writers ("chunked", "split") and, at run time, by the
generator's prompt chunking (lowering/prefill.py). A module of its own: the writers import
torch-to-nnef, which a machine that only runs artifacts (a GPU box, say) need not have."""

SCAN_CHUNK = 32  # tokens of one chunk of the loop
SCAN_CHUNKS_PER_STEP = 2  # chunks one iteration of the loop takes
