"""Device kernels (Triton) and their float64 torch references."""
