"""Data: sources (official file formats, downloads), partitioners, FederatedDataset."""
