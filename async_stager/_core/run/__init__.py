"""_core/run: see CONTRIBUTING.md (the layers)."""
