"""_core: see CONTRIBUTING.md (the layers)."""
