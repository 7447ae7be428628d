"""_core/checksum: see CONTRIBUTING.md (the layers)."""
