"""The fusion IR: IterDomains, TensorViews, the fusion graph, its printer and verifier."""
