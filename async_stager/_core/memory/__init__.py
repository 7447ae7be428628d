"""_core/memory: see CONTRIBUTING.md (the layers)."""
