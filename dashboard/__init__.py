"""megascope's Dash dashboard: the 3D parallel-topology heatmap and the views beside it."""
