"""Tests of the staging pipeline (_core): walk, memory, copy, plan, run, aio; the Stager."""
