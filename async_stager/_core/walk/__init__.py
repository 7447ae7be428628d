"""_core/walk: see CONTRIBUTING.md (the layers)."""
