"""The benchmarks, chaos runs and the layering of the code itself."""
