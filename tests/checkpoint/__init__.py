"""Tests of the Checkpointer (_checkpoint): saves, commits, restore, ranks, crashes; the child scripts they run."""
