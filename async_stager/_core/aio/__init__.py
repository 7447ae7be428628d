"""_core/aio: see CONTRIBUTING.md (the layers)."""
