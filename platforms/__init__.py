"""In-tree platform plugins. Each subpackage registers through the `portaserve.platforms`
entry-point group exactly as a third-party package would; none is imported by the core."""
