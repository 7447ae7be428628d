"""Tests of the writer-process handoff and the torch.multiprocessing reducers (_share)."""
