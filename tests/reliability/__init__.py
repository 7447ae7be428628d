"""Tests of cancellation storms, injected faults, bad input, leaks, interpreter exit and fork."""
