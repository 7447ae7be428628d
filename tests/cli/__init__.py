"""Tests of the command line (_cli): bench, check, verify."""
