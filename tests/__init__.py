"""The test suite (a package, so mypy names its modules tests.*; conftest puts this
folder on sys.path for the helper modules and the child scripts)."""
