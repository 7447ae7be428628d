"""_checkpoint: see CONTRIBUTING.md (the layers)."""
