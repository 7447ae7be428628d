"""_core/copy: see CONTRIBUTING.md (the layers)."""
