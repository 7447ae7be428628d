"""Tests of the docs' code blocks, the examples, the module map."""
