"""The fusion IR: IterDomains, TensorViews, the fusion graph, meshes, placements and layouts,
its printer and verifier."""
