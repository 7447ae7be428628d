"""_core/plan: see CONTRIBUTING.md (the layers)."""
