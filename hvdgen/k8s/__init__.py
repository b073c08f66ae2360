"""Kubernetes: MPIJob manifests for generated projects, and their validation."""
