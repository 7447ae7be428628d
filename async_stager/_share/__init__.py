"""_share: see CONTRIBUTING.md (the layers)."""
