"""_dcp: see CONTRIBUTING.md (the layers)."""
