"""Model code and weight loaders."""
